// Stage 3's offloaded weight shards (Note [Offloaded parameters]). See shard_file.h.
#include "loom/sharding/shard_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <future>

#include "loom/error.h"
#include "loom/memory.h"

namespace loom::sharding {

// A staged fetch or store, a task on the worker thread. The task sets `join` and then ends
// `done`; the driver's thread reads `join` only after `done`, which orders the two.
struct StagedMove {
  bool store = false;
  std::promise<void> finished;
  std::shared_future<void> done = finished.get_future().share();
  // A fetch on a GPU: makes the calling thread's stream wait for the copy; it holds the
  // staging buffer the copy reads until the move is dropped (after the gather's host read).
  std::function<void()> join;
  bool joined = false;
};

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

// Each unit's host form in the "cpu" arena starts on a cache line.
constexpr int64_t kArenaAlign = 64;

// Runs `task` on the worker as `move`'s, its error kept for whoever waits for the move.
void post_move(offload::WorkerThread& worker, const std::shared_ptr<StagedMove>& move,
               std::function<void()> task) {
  worker.post([move, task = std::move(task)] {
    try {
      task();
      move->finished.set_value();
    } catch (...) {
      move->finished.set_exception(std::current_exception());
    }
  });
}

}  // namespace

// Note [Diverged ranks]: the element after a stage-3 chunk carries its unit's position (half
// types: the element's bits as int16, exact to 32767 units).
void set_tag(UnitShard& unit) {
  if (unit.shard.element_size() == 2) unit.shard.view(at::kShort)[unit.chunk] = unit.position;
  else unit.shard[unit.chunk] = unit.position;
}

ShardFile::ShardFile(const offload::OffloadOptions& options, at::ScalarType dtype,
                     c10::Device device, bool staged, const std::vector<UnitShard*>& units)
    : dtype_(dtype),
      device_(device),
      staged_(staged),
      pin_(options.pin_memory && device.is_cuda()) {
  LOOM_INTERNAL_ASSERT(options.device == "nvme" || (options.device == "cpu" && staged),
                       "offload_param's shards on ", options.device, (staged ? "" : " unstaged"));
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  if (options.device == "cpu") {
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (const UnitShard* unit : units) {
      offsets.push_back(total);
      total += ((unit->chunk + 1) * element + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
    }
    total = std::max<int64_t>(total, 1);
    try {
      arena_ = at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(pin_));
    } catch (const std::exception& error) {
      throw ConfigError(detail::cat(
          "offload_param.device = \"cpu\": cannot allocate ", memory::format_bytes(total),
          pin_ ? " of page-locked" : " of", " host memory for the weight shards (", error.what(),
          "); use device = \"nvme\"",
          pin_ ? ", shard them over more ranks, or set pin_memory = false (pageable memory, "
                 "slower copies to and from the GPU)"
               : " or shard them over more ranks"));
    }
    for (size_t k = 0; k < units.size(); ++k) {
      UnitShard& unit = *units[k];
      at::Tensor home = arena_.narrow(0, offsets[k], (unit.chunk + 1) * element).view(dtype_);
      home.copy_(unit.shard);
      unit.shard = home;
    }
  } else {
    int64_t capacity = 0;
    for (const UnitShard* unit : units) capacity += offload::align_up((unit->chunk + 1) * element);
    file_ = std::make_unique<offload::SwapFile>(options.nvme, capacity);
    for (UnitShard* unit : units) {
      unit->region = file_->allocate((unit->chunk + 1) * element);
      at::Tensor aligned = aligned_tensor(unit->chunk + 1, dtype_);
      aligned.copy_(unit->shard);
      unit->shard = aligned;
      flush(*unit);
    }
    for (UnitShard* unit : units) settle(*unit);
  }
  if (staged_) {
    copies_ = std::make_unique<offload::CopyStream>(device_);
    worker_ = std::make_unique<offload::WorkerThread>();
  }
}

ShardFile::~ShardFile() = default;

std::string ShardFile::describe() const {
  if (file_)
    return detail::cat("on NVMe (", file_->file(), ")",
                       staged_ ? (pin_ ? ", fetched through page-locked staging buffers"
                                       : ", fetched through staging buffers")
                               : "");
  return detail::cat("in ", pin_ ? "page-locked " : "", "host memory (",
                     memory::format_bytes(arena_.nbytes()), ")");
}

const std::string& ShardFile::file() const {
  LOOM_INTERNAL_ASSERT(file_, "offload_param.device = \"cpu\" has no swap file");
  return file_->file();
}

at::Tensor ShardFile::staging(int64_t numel) const {
  if (!pin_) return aligned_tensor(numel, dtype_);
  const int64_t bytes = offload::align_up(std::max<int64_t>(1, numel) * c10::elementSize(dtype_));
  at::Tensor block;
  try {
    block = at::empty({bytes + offload::kAlignment},
                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  } catch (const std::exception& error) {
    throw ConfigError(detail::cat(
        "offload_param.device = \"nvme\": cannot allocate ", memory::format_bytes(bytes),
        " of page-locked host memory for a weight shard's staging buffer (", error.what(),
        "); set pin_memory = false (pageable memory, slower copies to and from the GPU)"));
  }
  // O_DIRECT wants the buffer on a 4 KiB boundary; the block stays alive as long as the view.
  auto* base = static_cast<char*>(block.data_ptr());
  const auto past = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base) % offload::kAlignment);
  return at::from_blob(base + (past ? offload::kAlignment - past : 0), {numel},
                       [block](void*) {}, at::TensorOptions().dtype(dtype_));
}

at::Tensor ShardFile::read(const UnitShard& unit) const {
  if (!file_) return unit.shard;
  at::Tensor shard = aligned_tensor(unit.chunk + 1, dtype_);
  file_->wait(file_->read(unit.region, shard.data_ptr()));
  return shard;
}

bool ShardFile::read_ahead(UnitShard& unit) {
  if (staged_) {
    if (unit.on_device.defined()) return false;
    start_fetch(unit);
    return true;
  }
  if (unit.shard.defined()) return false;
  unit.shard = aligned_tensor(unit.chunk + 1, dtype_);
  unit.ticket = file_->read(unit.region, unit.shard.data_ptr());
  unit.writing = false;
  return true;
}

void ShardFile::start_fetch(UnitShard& unit) {
  settle(unit);  // a store still on its way home lands first (update() leaves none)
  auto move = std::make_shared<StagedMove>();
  // Allocated here, on the compute stream, which the copy stream waits for before writing it:
  // the worker's current stream is the device's default stream, loom's compute stream.
  const at::Tensor on_device =
      at::empty({unit.chunk + 1}, at::TensorOptions().dtype(dtype_).device(device_));
  const at::Tensor from = file_ ? staging(unit.chunk + 1) : unit.shard;
  post_move(*worker_, move, [move, on_device, from, file = file_.get(), region = unit.region,
                             copies = copies_.get()] {
    if (file) file->wait(file->read(region, from.data_ptr()));
    auto join = copies->start_for_stream(on_device, from);
    if (copies->on_device()) move->join = std::move(join);
    else join();  // Note [Parameter offload twin]: the copy itself, here on the worker
  });
  unit.on_device = on_device;
  unit.moving = std::move(move);
}

at::Tensor ShardFile::fetch(UnitShard& unit) {
  if (!staged_) {
    make_resident(unit, /*read=*/true);
    return unit.shard;
  }
  if (!unit.on_device.defined()) start_fetch(unit);
  StagedMove& move = *unit.moving;
  try {
    move.done.get();
  } catch (...) {
    unit.on_device = at::Tensor();
    unit.moving.reset();
    throw;
  }
  if (move.join && !move.joined) move.join();  // the stream waits on the device, not the host
  move.joined = true;
  return unit.on_device;
}

void ShardFile::gathered(UnitShard& unit) {
  if (!staged_) {
    unit.shard = at::Tensor();  // unchanged: nothing to write back
    return;
  }
  unit.on_device = at::Tensor();
  unit.moving.reset();
}

void ShardFile::drop_fetch(UnitShard& unit) {
  if (!staged_) {
    if (unit.ticket >= 0 && !unit.writing) {
      settle(unit);
      unit.shard = at::Tensor();
    }
    return;
  }
  if (!unit.on_device.defined()) return;
  // A copy may still be writing the device buffer: the stream waits for it before the
  // allocator can hand the bytes to another kernel.
  (void)fetch(unit);
  gathered(unit);
}

void ShardFile::settle(UnitShard& unit) {
  if (unit.moving && unit.moving->store) {
    const std::shared_ptr<StagedMove> move = std::move(unit.moving);
    std::erase(writes_, &unit);
    try {
      move->done.get();
    } catch (...) {
      if (file_) unit.shard = at::Tensor();  // not written
      throw;
    }
    if (file_) unit.shard = at::Tensor();  // the file holds it now
  } else if (unit.moving) {
    unit.moving->done.get();  // a fetch: landed, kept for its gather
  }
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
  LOOM_INTERNAL_ASSERT(file_, "a weight shard missing from the host arena");
  if (read) {
    unit.shard = this->read(unit);
  } else {
    unit.shard = aligned_tensor(unit.chunk + 1, dtype_);
    unit.shard.zero_();
    set_tag(unit);
  }
}

void ShardFile::flush(UnitShard& unit) {
  if (!file_ || !unit.shard.defined() || unit.writing || unit.moving) return;
  settle(unit);  // a read ahead still landing (its bytes are the file's: rewriting is harmless)
  while (writes_.size() >= kShardWritesInFlight) settle(*writes_.front());
  unit.ticket = file_->write(unit.region, unit.shard.data_ptr());
  unit.writing = true;
  writes_.push_back(&unit);
}

void ShardFile::store(UnitShard& unit, const at::Tensor& master) {
  LOOM_INTERNAL_ASSERT(master.numel() == unit.chunk, "a master of ", master.numel(),
                       " elements for a shard of ", unit.chunk);
  if (!staged_) {
    make_resident(unit, /*read=*/false);
    unit.shard.narrow(0, 0, unit.chunk).copy_(master);
    flush(unit);
    return;
  }
  settle(unit);
  while (writes_.size() >= kShardWritesInFlight) settle(*writes_.front());
  // Cast where the master is (the device), then home on the copy stream, which waits for
  // the cast; started here, on the thread whose stream queued the cast.
  const at::Tensor values = master.to(dtype_);
  if (file_) {
    unit.shard = staging(unit.chunk + 1);
    set_tag(unit);
  }
  auto landed = copies_->start(unit.shard.narrow(0, 0, unit.chunk), values);
  auto move = std::make_shared<StagedMove>();
  move->store = true;
  post_move(*worker_, move, [landed = std::move(landed), file = file_.get(),
                             region = unit.region, host = unit.shard] {
    landed();  // the twin: the copy itself, here on the worker
    if (file) file->wait(file->write(region, host.data_ptr()));
  });
  unit.moving = std::move(move);
  writes_.push_back(&unit);
}

int64_t ShardFile::device_bytes(const UnitShard& unit) const {
  const at::Tensor& held = staged_ ? unit.on_device : unit.shard;
  return held.defined() ? static_cast<int64_t>(held.nbytes()) : 0;
}

}  // namespace loom::sharding
