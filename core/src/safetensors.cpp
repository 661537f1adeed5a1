// safetensors reader and writer. Format: 8 bytes little-endian u64 N, N bytes of JSON header,
// then the data. Every bound in a file is checked before it is trusted.
#include "loom/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint_format.h"
#include "fsutil.h"
#include "loom/error.h"

namespace loom::safetensors {
namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"},  {at::kHalf, "F16"},  {at::kBFloat16, "BF16"}, {at::kDouble, "F64"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"},     {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

}  // namespace

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  throw CheckpointError(detail::cat("safetensors cannot store dtype ", c10::toString(type)));
}

void save(const std::filesystem::path& file, const NamedTensors& tensors,
          const Metadata& metadata) {
  std::vector<StreamedTensor> streamed;
  for (const auto& [name, tensor] : tensors) {
    LOOM_CHECK_AS(CheckpointError, tensor.defined(), "tensor '", name, "' is undefined");
    streamed.push_back({name, tensor.scalar_type(), tensor.sizes().vec(),
                        [tensor = tensor] { return tensor; }});
  }
  save_streamed(file, streamed, metadata);
}

void save_streamed(const std::filesystem::path& file, const std::vector<StreamedTensor>& tensors,
                   const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    LOOM_CHECK_AS(CheckpointError, !header.contains(t.name) && t.name != "__metadata__",
                  "tensor name '", t.name, "' appears twice in ", file.string());
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const uint64_t bytes = static_cast<uint64_t>(numel) * c10::elementSize(t.dtype);
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  fsutil::AtomicFile out(file);
  uint64_t length = text.size();
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(length >> (8 * i));
  out.write(le, 8);
  out.write(text.data(), text.size());
  for (const auto& t : tensors) {
    const at::Tensor values = t.produce().detach().to(at::kCPU).contiguous();
    LOOM_INTERNAL_ASSERT(values.scalar_type() == t.dtype && values.sizes().vec() == t.shape,
                         "tensor '", t.name, "' was produced as ", c10::toString(values.scalar_type()),
                         " ", values.sizes(), " but declared ", c10::toString(t.dtype));
    out.write(values.data_ptr(), values.numel() * values.element_size());
  }
  out.commit();
}

Header read_header(const std::filesystem::path& file) {
  const std::string name = file.string();
  std::ifstream in(file, std::ios::binary);
  LOOM_CHECK_AS(CheckpointError, in.good(), "cannot open '", name, "'");
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  std::string prefix(std::min<uint64_t>(size, 8), '\0');
  in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  std::string text(format::safetensors_header_length(prefix, size, name), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  LOOM_CHECK_AS(CheckpointError, in.good(), "'", name, "': reading its header failed");
  format::SafetensorsHeader parsed = format::parse_safetensors_header(text, size, name);
  Header header;
  header.data_start = parsed.data_start;
  header.metadata = std::move(parsed.metadata);
  for (auto& e : parsed.entries) {
    auto type = dtype_of(e.dtype);
    LOOM_INTERNAL_ASSERT(type, "dtype ", e.dtype, " has a size but no ScalarType");
    header.entries.push_back({std::move(e.name), *type, std::move(e.shape), e.begin, e.end});
  }
  return header;
}

at::Tensor read_tensor(const std::filesystem::path& file, const Header& header,
                       const Entry& entry) {
  std::ifstream in(file, std::ios::binary);
  LOOM_CHECK_AS(CheckpointError, in.good(), "cannot open '", file.string(), "'");
  at::Tensor tensor = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
  in.seekg(static_cast<std::streamoff>(header.data_start + entry.begin));
  in.read(static_cast<char*>(tensor.data_ptr()),
          static_cast<std::streamsize>(entry.end - entry.begin));
  LOOM_CHECK_AS(CheckpointError, in.good(), "'", file.string(), "': reading tensor '",
                entry.name, "' failed");
  return tensor;
}

Contents load(const std::filesystem::path& file) {
  Header header = read_header(file);
  Contents contents;
  contents.metadata = header.metadata;
  for (const auto& entry : header.entries)
    contents.tensors.emplace_back(entry.name, read_tensor(file, header, entry));
  return contents;
}

}  // namespace loom::safetensors
