// oneDNN's x86-64 ISA levels and which of them this CPU supports, from /proc/cpuinfo's flags.
// Pure bookkeeping: no LibTorch, no probing (that is cpu_probe.cpp), no process state.
#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "loom/cpu.h"
#include "loom/error.h"

namespace loom::cpu {
namespace {

struct Level {
  const char* name;                    // ONEDNN_MAX_CPU_ISA's name, lower-cased
  const char* alias;                   // oneDNN 3's other name for it ("" when none)
  std::vector<const char*> flags;      // what /proc/cpuinfo must list
};

// Best first. The requirements are oneDNN's (src/cpu/x64/cpu_isa_traits.hpp, mayiuse()),
// in the names the Linux kernel prints.
const std::vector<Level>& level_table() {
  static const std::vector<Level> table = [] {
    const std::vector<const char*> core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"};
    auto with = [&](std::vector<const char*> extra) {
      std::vector<const char*> out = core;
      out.insert(out.end(), extra.begin(), extra.end());
      return out;
    };
    return std::vector<Level>{
        {"avx512_core_amx_fp16", "avx10_1_512_amx_fp16",
         with({"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
               "amx_fp16"})},
        {"avx512_core_amx", "avx10_1_512_amx",
         with({"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"})},
        {"avx512_core_fp16", "avx10_1_512", with({"avx512_vnni", "avx512_bf16", "avx512_fp16"})},
        {"avx512_core_bf16", "", with({"avx512_vnni", "avx512_bf16"})},
        {"avx512_core_vnni", "", with({"avx512_vnni"})},
        {"avx512_core", "", core},
        {"avx2_vnni_2", "", {"avx2", "fma", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"}},
        {"avx2_vnni", "", {"avx2", "fma", "avx_vnni"}},
        {"avx2", "", {"avx2", "fma"}},
        {"avx", "", {"avx"}},
        {"sse41", "", {"sse4_1"}},
    };
  }();
  return table;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

}  // namespace

const std::vector<std::string>& isa_levels() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& level : level_table()) out.emplace_back(level.name);
    return out;
  }();
  return names;
}

std::string canonical_isa(const std::string& name) {
  const std::string wanted = lower(trim(name));
  for (const auto& level : level_table())
    if (wanted == level.name || (*level.alias && wanted == level.alias)) return level.name;
  return "";
}

bool CpuInfo::has(const std::string& flag) const {
  return std::find(flags.begin(), flags.end(), flag) != flags.end();
}

CpuInfo parse_cpu_info(const std::string& cpuinfo) {
  // The first processor's block is enough: a VM or a socket does not mix CPU models.
  CpuInfo info;
  std::istringstream in(cpuinfo);
  std::string line;
  bool have_flags = false;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trim(line.substr(0, colon));
    const std::string value = trim(line.substr(colon + 1));
    if (key == "model name" && info.model.empty()) info.model = value;
    if (key == "flags" && !have_flags) {
      std::istringstream words(value);
      for (std::string flag; words >> flag;) info.flags.push_back(flag);
      have_flags = true;
    }
  }
  if (info.model.empty()) info.model = "unknown CPU";
  return info;
}

CpuInfo read_cpu_info() {
  std::ifstream in("/proc/cpuinfo");
  std::stringstream text;
  text << in.rdbuf();
  return parse_cpu_info(text.str());
}

std::vector<std::string> supported_isa_levels(const CpuInfo& cpu) {
  std::vector<std::string> out;
  for (const auto& level : level_table())
    if (std::all_of(level.flags.begin(), level.flags.end(),
                    [&](const char* flag) { return cpu.has(flag); }))
      out.emplace_back(level.name);
  return out;
}

const std::vector<std::string>& relevant_flags() {
  static const std::vector<std::string> flags = {
      "sse4_1", "avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
      "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16"};
  return flags;
}

std::string IsaChoice::summary() const {
  std::string out;
  if (!cpu_best.empty() && level != cpu_best) out = cpu_best + " -> ";
  out += level.empty() ? std::string("oneDNN's default") : level;
  if (!reason.empty()) out += " (" + reason + ")";
  return out;
}

std::string parse_job_isa(const std::string& value, const std::string& where) {
  if (lower(trim(value)) == "auto") return "auto";
  const std::string level = canonical_isa(value);
  if (!level.empty()) return level;
  std::string valid = "auto";
  for (const auto& name : isa_levels()) valid += ", " + name;
  throw ConfigError(detail::cat(where, ": [train] cpu_isa '", value,
                                "' is no oneDNN ISA level; use one of: ", valid,
                                " (`loom env` shows the levels this CPU supports)"));
}

}  // namespace loom::cpu
