// Parses job files with TOML++ into ConfigValue trees that remember file:line, and applies
// --set overrides. No LibTorch here: this TU stays cheap to compile.
#include "job.h"
#include "deepspeed_config.h"
#include "dist_env.h"
#include "trainer_names.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>

namespace loom {
namespace {

std::string where_of(const toml::node& node, const std::string& fallback) {
  const auto& source = node.source();
  if (source.begin.line == 0) return fallback;
  return detail::cat(source.path ? *source.path : fallback, ":", source.begin.line);
}

ConfigValue convert(const toml::node& node, const std::string& file) {
  ConfigValue out;
  out.where = where_of(node, file);
  if (auto v = node.as_integer()) {
    out.value = v->get();
  } else if (auto f = node.as_floating_point()) {
    out.value = f->get();
  } else if (auto b = node.as_boolean()) {
    out.value = b->get();
  } else if (auto s = node.as_string()) {
    out.value = s->get();
  } else if (auto a = node.as_array()) {
    ConfigArray array;
    for (const auto& item : *a) array.push_back(convert(item, file));
    out.value = std::move(array);
  } else if (auto t = node.as_table()) {
    ConfigTable table;
    for (const auto& [key, child] : *t) table.emplace_back(std::string(key.str()), convert(child, file));
    out.value = std::move(table);
  } else {
    throw ConfigError(detail::cat(out.where, ": dates and times are not valid loom values"));
  }
  return out;
}

void apply_override(ConfigValue& root, const std::string& text) {
  const auto eq = text.find('=');
  LOOM_CHECK_AS(ConfigError, eq != std::string::npos && eq > 0,
                "--set '", text, "' must look like table.key=value (e.g. train.max_steps=10)");
  const std::string path = text.substr(0, eq);
  const std::string raw = text.substr(eq + 1);
  const auto dot = path.find('.');
  LOOM_CHECK_AS(ConfigError, dot != std::string::npos && dot > 0 && dot + 1 < path.size(),
                "--set '", text, "': the key must name its table, e.g. train.max_steps=10");
  const std::string table_name = path.substr(0, dot), key = path.substr(dot + 1);
  ConfigValue value;
  // The value is TOML (10, 3e-4, true, "x", [1, 2]); anything that does not parse is a string.
  try {
    auto parsed = toml::parse("v = " + raw);
    value = convert(*parsed.get("v"), "--set");
  } catch (const toml::parse_error&) {
    value.value = raw;
  }
  value.where = "--set " + text;
  ConfigValue* table = root.find(table_name);
  auto& tables = std::get<ConfigTable>(root.value);
  if (!table) {
    tables.emplace_back(table_name, ConfigValue{ConfigTable{}, "--set " + text});
    table = &tables.back().second;
  }
  LOOM_CHECK_AS(ConfigError, table->is_table(), "--set ", text, ": '", table_name,
                "' is not a table");
  if (ConfigValue* existing = table->find(key))
    *existing = std::move(value);
  else
    std::get<ConfigTable>(table->value).emplace_back(key, std::move(value));
}

Job from_toml(const toml::table& parsed, const std::filesystem::path& file,
              const std::vector<std::string>& overrides) {
  Job job;
  job.file = file;
  job.dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  job.overrides = overrides;
  ConfigTable tables;
  for (const auto& [key, node] : parsed) {
    LOOM_CHECK_AS(ConfigError, node.is_table(), where_of(node, file.string()),
                  ": top-level key '", key.str(), "' must sit inside a table such as [train]");
    tables.emplace_back(std::string(key.str()), convert(node, file.string()));
  }
  job.root.value = std::move(tables);
  job.root.where = file.string();
  // Note [DeepSpeed config files]: the file is read onto loom's tables before the other
  // overrides, so `--set` has the last word over it too (and a probe's overrides apply to the
  // mapped job); only an override naming the file itself comes first.
  const auto names_the_file = [](const std::string& text) {
    return text.rfind("train.deepspeed=", 0) == 0;
  };
  for (const auto& text : overrides)
    if (names_the_file(text)) apply_override(job.root, text);
  DeepSpeedMapping deepspeed =
      map_deepspeed_config(job.root, job.dir, detect_dist_env().world_size);
  for (const auto& text : overrides)
    if (!names_the_file(text)) apply_override(job.root, text);
  job.notes = std::move(deepspeed.notes);
  job.warnings = std::move(deepspeed.warnings);
  for (auto& note : map_trainer_names(job.root)) job.notes.push_back(std::move(note));
  return job;
}

}  // namespace

namespace {

// Note [Bounded nesting]: the TOML parser recurses once per level of nested arrays, inline
// tables and dotted keys, so a hostile or broken file 12 000 levels deep overflows the stack.
// Real jobs nest two or three levels; past kMaxNesting the file is refused, naming the line.
// The same scan refuses non-ASCII bytes outside strings and comments (see below).
constexpr int kMaxNesting = 64;

void check_nesting(const std::string& text, const std::filesystem::path& name) {
  int depth = 0, line = 1, dots = 0;
  bool key_part = true;  // before this line's '=' (where dots nest tables), at depth 0
  char quote = 0;        // inside a string: its quote
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n') {
      ++line;
      key_part = depth == 0;
      dots = 0;
      continue;
    }
    if (quote) {
      if (ch == '\\' && quote == '"') ++i;
      else if (ch == quote) quote = 0;
      continue;
    }
    // TOML allows other than ASCII only in strings and comments; TOML++ 3.3 reaches
    // __builtin_unreachable() classifying some such characters elsewhere (U+00A1-U+0499, found
    // by tests/fuzz), so they are refused here, before the parser sees them.
    LOOM_CHECK_AS(ConfigError, static_cast<unsigned char>(ch) < 0x80, name.string(), ":", line,
                  ": a character other than ASCII outside a string or comment; TOML keys and "
                  "values other than strings are ASCII (put text in quotes)");
    if (ch == '"' || ch == '\'') quote = ch;
    else if (ch == '#') {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if (ch == '[' || ch == '{') ++depth;
    else if (ch == ']' || ch == '}') depth = std::max(0, depth - 1);
    else if (ch == '=') key_part = false;
    else if (ch == '.' && (key_part || depth > 0)) {
      const char next = i + 1 < text.size() ? text[i + 1] : 0;
      if (!std::isdigit(static_cast<unsigned char>(next))) ++dots;  // not a float's point
    }
    LOOM_CHECK_AS(ConfigError, depth <= kMaxNesting && dots <= kMaxNesting, name.string(), ":",
                  line, ": the job nests deeper than ", kMaxNesting,
                  " levels (arrays, inline tables or dotted keys); a loom job needs a few");
  }
}

}  // namespace

Job Job::load(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::exists(file, ec)) {  // a missing file is the read's error below
    LOOM_CHECK_AS(ConfigError, std::filesystem::is_regular_file(file, ec), "job file '",
                  file.string(), "' is not a regular file; pass the path of a .toml job file");
    LOOM_CHECK_AS(ConfigError, std::filesystem::file_size(file, ec) <= (16u << 20), "job file '",
                  file.string(), "' is over 16 MiB; a job file is a few kilobytes");
  }
  std::ifstream in(file);
  LOOM_CHECK_AS(ConfigError, in.good(), "cannot read job file '", file.string(),
                "': it does not exist or is not readable; pass the path of a .toml job file");
  std::stringstream text;
  text << in.rdbuf();
  return parse(text.str(), file, overrides);
}

Job Job::parse(const std::string& text, const std::filesystem::path& name,
               const std::vector<std::string>& overrides) {
  check_nesting(text, name);
  try {
    auto parsed = toml::parse(text, name.string());
    Job job = from_toml(parsed, name, overrides);
    job.text = text;
    return job;
  } catch (const toml::parse_error& error) {
    const auto& source = error.source();
    throw ConfigError(detail::cat(name.string(), ":", source.begin.line, ":",
                                  source.begin.column, ": invalid TOML: ", error.description()));
  }
}

std::optional<ConfigValue> take_key(ConfigValue& root, std::string_view table, std::string_view key) {
  ConfigValue* t = root.find(table);
  if (!t || !t->is_table()) return std::nullopt;
  auto& items = std::get<ConfigTable>(t->value);
  for (auto it = items.begin(); it != items.end(); ++it)
    if (it->first == key) {
      ConfigValue out = std::move(it->second);
      items.erase(it);
      return out;
    }
  return std::nullopt;
}

ConfigValue& table_of(ConfigValue& root, const std::string& name, const std::string& where) {
  if (ConfigValue* t = root.find(name)) {
    LOOM_CHECK_AS(ConfigError, t->is_table(), t->where, ": '", name, "' is not a table");
    return *t;
  }
  auto& tables = std::get<ConfigTable>(root.value);
  tables.emplace_back(name, ConfigValue{ConfigTable{}, where});
  return tables.back().second;
}

std::string display_text(const ConfigValue& value) {
  if (value.type() != ValueType::Float) return value.to_text();
  const double x = std::get<double>(value.value);
  char text[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, x);
    if (std::strtod(text, nullptr) == x) break;
  }
  return text;
}

std::vector<std::string> Job::table_names() const {
  std::vector<std::string> names;
  for (const auto& [name, value] : std::get<ConfigTable>(root.value)) names.push_back(name);
  return names;
}

std::string Job::canonical_text() const {
  std::vector<std::string> lines;
  std::function<void(const std::string&, const ConfigValue&)> walk =
      [&](const std::string& prefix, const ConfigValue& value) {
        if (const auto* table = std::get_if<ConfigTable>(&value.value)) {
          for (const auto& [key, child] : *table)
            walk(prefix.empty() ? key : prefix + "." + key, child);
        } else {
          lines.push_back(prefix + " = " + value.to_text());
        }
      };
  walk("", root);
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

std::string Job::hash() const {
  // FNV-1a 64: a fingerprint to notice a changed job on resume, not a security hash. Where the
  // run writes, what it resumes, how it reports and whether it saves in the background change
  // nothing it trains: a checkpoint resumed into another folder (or evaluated alone by `loom
  // eval`) is the same job.
  static const char* const kNotTrained[] = {"train.output_dir = ", "train.resume = ",
                                            "train.progress_bar = ", "train.log_level = ",
                                            "train.log_all_ranks = ", "train.async_save = "};
  uint64_t h = 1469598103934665603ull;
  std::istringstream lines(canonical_text());
  for (std::string line; std::getline(lines, line);) {
    bool skip = false;
    for (const char* prefix : kNotTrained) skip |= line.rfind(prefix, 0) == 0;
    if (skip) continue;
    for (unsigned char c : line + "\n") {
      h ^= c;
      h *= 1099511628211ull;
    }
  }
  char buffer[17];
  std::snprintf(buffer, sizeof buffer, "%016llx", static_cast<unsigned long long>(h));
  return buffer;
}

}  // namespace loom
