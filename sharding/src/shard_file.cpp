// Stage 3's parameter swap file (Note [Offloaded parameters]). See shard_file.h.
#include "loom/sharding/shard_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>

#include "loom/error.h"

namespace loom::sharding {

namespace {

// A CPU tensor on memory aligned for O_DIRECT (the parameter swap file reads and writes it).
at::Tensor aligned_tensor(int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = offload::align_up(std::max<int64_t>(1, numel) * c10::elementSize(dtype));
  void* memory = nullptr;
  LOOM_CHECK(posix_memalign(&memory, offload::kAlignment, static_cast<size_t>(bytes)) == 0,
             "cannot allocate ", bytes, " bytes for a weight shard read from NVMe");
  return at::from_blob(memory, {numel}, [](void* p) { std::free(p); },
                       at::TensorOptions().dtype(dtype));
}

// Note [Offloaded parameters]: a few writes fly at once, so the walk goes on while they land
// without every unit's shard piling up in memory when the disk is slower than the walk.
constexpr size_t kShardWritesInFlight = 2;

}  // namespace

// Note [Diverged ranks]: the element after a stage-3 chunk carries its unit's position (half
// types: the element's bits as int16, exact to 32767 units).
void set_tag(UnitShard& unit) {
  if (unit.shard.element_size() == 2) unit.shard.view(at::kShort)[unit.chunk] = unit.position;
  else unit.shard[unit.chunk] = unit.position;
}

ShardFile::ShardFile(const offload::NvmeOptions& nvme, at::ScalarType dtype,
                     const std::vector<UnitShard*>& units)
    : dtype_(dtype) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t capacity = 0;
  for (const UnitShard* unit : units) capacity += offload::align_up((unit->chunk + 1) * element);
  file_ = std::make_unique<offload::SwapFile>(nvme, capacity);
  for (UnitShard* unit : units) {
    unit->region = file_->allocate((unit->chunk + 1) * element);
    at::Tensor aligned = aligned_tensor(unit->chunk + 1, dtype_);
    aligned.copy_(unit->shard);
    unit->shard = aligned;
    flush(*unit);
  }
  for (UnitShard* unit : units) settle(*unit);
}

ShardFile::~ShardFile() = default;

const std::string& ShardFile::file() const { return file_->file(); }

at::Tensor ShardFile::read(const UnitShard& unit) const {
  at::Tensor shard = aligned_tensor(unit.chunk + 1, dtype_);
  file_->wait(file_->read(unit.region, shard.data_ptr()));
  return shard;
}

bool ShardFile::read_ahead(UnitShard& unit) {
  if (unit.shard.defined()) return false;
  unit.shard = aligned_tensor(unit.chunk + 1, dtype_);
  unit.ticket = file_->read(unit.region, unit.shard.data_ptr());
  unit.writing = false;
  return true;
}

void ShardFile::settle(UnitShard& unit) {
  if (unit.ticket < 0) return;
  const int64_t ticket = unit.ticket;
  const bool writing = unit.writing;
  unit.ticket = -1;
  unit.writing = false;
  if (writing) std::erase(writes_, &unit);
  try {
    file_->wait(ticket);
  } catch (...) {
    unit.shard = at::Tensor();  // half read (nobody may use it) or not written
    throw;
  }
  if (writing) unit.shard = at::Tensor();  // the file holds it now
}

void ShardFile::make_resident(UnitShard& unit, bool read) {
  settle(unit);
  if (unit.shard.defined()) return;
  if (read) {
    unit.shard = this->read(unit);
  } else {
    unit.shard = aligned_tensor(unit.chunk + 1, dtype_);
    unit.shard.zero_();
    set_tag(unit);
  }
}

void ShardFile::flush(UnitShard& unit) {
  if (!unit.shard.defined() || unit.writing) return;
  settle(unit);  // a read ahead still landing (its bytes are the file's: rewriting is harmless)
  while (writes_.size() >= kShardWritesInFlight) settle(*writes_.front());
  unit.ticket = file_->write(unit.region, unit.shard.data_ptr());
  unit.writing = true;
  writes_.push_back(&unit);
}

}  // namespace loom::sharding
