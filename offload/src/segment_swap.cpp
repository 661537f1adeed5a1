// Segments in a swap file and the pipelined walk over them. See loom/offload/segment_swap.h.
#include "loom/offload/segment_swap.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>

#include "loom/error.h"
#include "loom/memory.h"

namespace loom::offload {
namespace {

constexpr int64_t kTensorAlign = 64;  // each state tensor starts on a cache line

int64_t align_to(int64_t bytes, int64_t unit) { return (bytes + unit - 1) / unit * unit; }

}  // namespace

SegmentSwap::SegmentSwap(const UpdateRule& rule, std::vector<SwapSegment> segments,
                         const OffloadOptions& options)
    : rule_(rule) {
  LOOM_CHECK_AS(ConfigError, options.buffer_count >= 3, "offload_optimizer.buffer_count = ",
                options.buffer_count, " is too few: the pipelined update needs 3 (one read, "
                "one updated, one written)");
  for (auto& s : segments) {
    Entry e;
    LOOM_INTERNAL_ASSERT(!s.in_place.defined() || (s.in_place.is_cpu() &&
                                                   s.in_place.scalar_type() == at::kFloat &&
                                                   s.in_place.numel() == s.numel),
                         "segment ", s.name, ": in-place values must be fp32 CPU of its size");
    LOOM_INTERNAL_ASSERT(!s.in_place.defined() || !s.no_master, "segment ", s.name,
                         ": in place and without a master");
    // The piece's state shapes, from the rule on the meta device.
    Segment meta;
    meta.name = s.name;
    meta.shape = s.shape;
    meta.offset = s.offset;
    meta.group = s.group;
    meta.param = at::empty({s.numel}, at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
    int64_t at_byte = s.in_place.defined() || s.no_master ? 0 : align_to(s.numel * 4, kTensorAlign);
    for (auto& [key, tensor] : rule_.init_state(meta)) {
      Layout l{key, tensor.scalar_type(), tensor.sizes().vec(), at_byte,
               tensor.numel() * static_cast<int64_t>(tensor.element_size())};
      at_byte = align_to(at_byte + l.bytes, kTensorAlign);
      e.state.push_back(std::move(l));
    }
    e.bytes = std::max<int64_t>(at_byte, 1);
    e.segment = std::move(s);
    total_ += align_up(e.bytes);
    largest_ = std::max(largest_, e.bytes);
    segments_.push_back(std::move(e));
  }
  if (options.device == "cpu") {  // Note [Host store]
    int64_t at = 0;
    for (auto& e : segments_) {
      e.region = at;
      at += align_to(e.bytes, kTensorAlign);
    }
    total_ = std::max<int64_t>(at, 1);
    try {
      if (options.pin_memory) {
        host_pinned_ = at::empty({total_}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
        host_base_ = static_cast<char*>(host_pinned_.data_ptr());
      } else {
        host_ = AlignedBuffer(total_);
        host_base_ = static_cast<char*>(host_.data());
      }
    } catch (const std::exception& error) {
      throw ConfigError(detail::cat(
          "offload_optimizer.device = \"cpu\": cannot allocate ", memory::format_bytes(total_),
          options.pin_memory ? " of page-locked" : " of", " host memory for the optimizer state (",
          error.what(), "); use device = \"nvme\"",
          options.pin_memory ? ", shard it over more ranks, or set pin_memory = false (pageable "
                               "memory, slower copies to and from the GPU)"
                             : " or shard it over more ranks"));
    }
    return;
  }
  file_ = std::make_unique<SwapFile>(options.nvme, std::max<int64_t>(total_, 1));
  for (auto& e : segments_) e.region = file_->allocate(e.bytes);
  for (int b = 0; b < options.buffer_count; ++b) buffers_.emplace_back(std::max<int64_t>(largest_, 1));
}

SegmentSwap::~SegmentSwap() = default;

Segment SegmentSwap::segment_over(const Entry& e, void* base) const {
  Segment segment;
  segment.name = e.segment.name;
  segment.shape = e.segment.shape;
  segment.offset = e.segment.offset;
  segment.group = e.segment.group;
  auto* bytes = static_cast<char*>(base);
  if (e.segment.in_place.defined()) segment.param = e.segment.in_place;
  else if (!e.segment.no_master)
    segment.param = at::from_blob(bytes, {e.segment.numel}, at::TensorOptions().dtype(at::kFloat));
  for (const auto& l : e.state)
    segment.state.emplace_back(
        l.key, at::from_blob(bytes + l.offset, l.shape, at::TensorOptions().dtype(l.dtype)));
  return segment;
}

void SegmentSwap::initialise(size_t i, const at::Tensor& values) {
  at::NoGradGuard no_grad;
  read_segment_ = -1;
  const Entry& e = segments_.at(i);
  void* base = host_base_ ? host_base_ + e.region : buffers_[0].data();
  Segment segment = segment_over(e, base);
  if (e.segment.no_master) segment.param = values.reshape(-1).to(at::kCPU, at::kFloat);
  else if (!e.segment.in_place.defined()) segment.param.copy_(values.reshape(-1));
  for (auto& [key, tensor] : rule_.init_state(segment)) segment.state_at(key).copy_(tensor);
  if (!host_base_) file_->wait(file_->write(e.region, base));
}

// Note [Pipelined update].
void SegmentSwap::walk(const std::function<bool(size_t, Segment&)>& visit) {
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const auto started = Clock::now();
  stats_ = {};
  if (host_base_) {  // Note [Host store]: every segment where it is
    for (size_t i = 0; i < segments_.size(); ++i) {
      Segment segment = segment_over(segments_[i], host_base_ + segments_[i].region);
      visit(i, segment);
    }
    stats_.compute_seconds = stats_.update_seconds = since(started);
    return;
  }
  read_segment_ = -1;
  read_buffer_ = AlignedBuffer();  // a checkpoint's, not kept between them
  const size_t n = segments_.size(), count = buffers_.size();
  std::vector<SwapFile::Ticket> reading(count, 0), writing(count, 0);
  auto wait = [&](SwapFile::Ticket ticket) {
    const auto t = Clock::now();
    file_->wait(ticket);
    stats_.io_wait_seconds += since(t);
  };
  auto start_read = [&](size_t i) {
    const size_t b = i % count;
    if (writing[b]) wait(writing[b]);  // the buffer's last segment is on disk
    writing[b] = 0;
    reading[b] = file_->read(segments_[i].region, buffers_[b].data());
    stats_.bytes_read += align_up(segments_[i].bytes);
  };
  // Reads run `ahead` segments ahead of the visit: every buffer but the one being visited and
  // the one being written holds a read in flight.
  const size_t ahead = count - 2;
  size_t issued = 0;
  try {
    for (size_t i = 0; i < n; ++i) {
      while (issued < n && issued <= i + ahead) start_read(issued++);
      const size_t b = i % count;
      wait(reading[b]);
      reading[b] = 0;
      const auto computing = Clock::now();
      Segment segment = segment_over(segments_[i], buffers_[b].data());
      const bool changed = visit(i, segment);
      stats_.compute_seconds += since(computing);
      if (!changed) continue;
      writing[b] = file_->write(segments_[i].region, buffers_[b].data());
      stats_.bytes_written += align_up(segments_[i].bytes);
    }
  } catch (...) {
    // No request may outlive this walk with a buffer a later walk reuses.
    for (auto ticket : reading)
      if (ticket) try { file_->wait(ticket); } catch (...) {}
    for (auto ticket : writing)
      if (ticket) try { file_->wait(ticket); } catch (...) {}
    throw;
  }
  for (auto ticket : writing)
    if (ticket) wait(ticket);
  stats_.update_seconds = since(started);
}

Segment SegmentSwap::host_segment(size_t i) const {
  LOOM_INTERNAL_ASSERT(host_base_, "host_segment() of a store in a swap file");
  return segment_over(segments_.at(i), host_base_ + segments_[i].region);
}

void SegmentSwap::each(const std::function<bool(size_t, Segment&)>& visit) const {
  if (host_base_) {
    for (size_t i = 0; i < segments_.size(); ++i) {
      Segment segment = segment_over(segments_[i], host_base_ + segments_[i].region);
      visit(i, segment);
    }
    return;
  }
  read_segment_ = -1;
  void* base = buffers_[0].data();
  for (size_t i = 0; i < segments_.size(); ++i) {
    const Entry& e = segments_[i];
    file_->wait(file_->read(e.region, base));
    Segment segment = segment_over(e, base);
    if (visit(i, segment)) file_->wait(file_->write(e.region, base));
  }
}

Segment SegmentSwap::meta_segment(size_t i) const {
  const Entry& e = segments_.at(i);
  Segment segment;
  segment.name = e.segment.name;
  segment.shape = e.segment.shape;
  segment.offset = e.segment.offset;
  segment.group = e.segment.group;
  const auto meta = at::TensorOptions().device(c10::kMeta);
  segment.param = at::empty({e.segment.numel}, meta.dtype(at::kFloat));
  for (const auto& l : e.state) segment.state.emplace_back(l.key, at::empty(l.shape, meta.dtype(l.dtype)));
  return segment;
}

at::Tensor SegmentSwap::read(size_t i, const std::string& key) const {
  const Entry& e = segments_.at(i);
  LOOM_INTERNAL_ASSERT(!key.empty() || separate_master(i), "segment ", e.segment.name,
                       " keeps no master in the store to read");
  if (host_base_) {
    const Segment segment = segment_over(e, host_base_ + e.region);
    return (key.empty() ? segment.param : segment.state_at(key)).clone();
  }
  if (read_segment_ != static_cast<int64_t>(i)) {
    if (read_buffer_.size() < largest_) read_buffer_ = AlignedBuffer(largest_);
    read_segment_ = -1;
    file_->wait(file_->read(e.region, read_buffer_.data()));
    read_segment_ = static_cast<int64_t>(i);
  }
  const Segment segment = segment_over(e, read_buffer_.data());
  if (key.empty()) return segment.param.clone();
  return segment.state_at(key).clone();
}

int64_t SegmentSwap::buffer_bytes() const {
  if (host_base_) return total_;
  int64_t bytes = 0;
  for (const auto& b : buffers_) bytes += b.size();
  return bytes;
}

int64_t SegmentSwap::file_bytes() const { return host_base_ ? 0 : total_; }

std::string SegmentSwap::describe() const {
  if (host_base_)
    return detail::cat(memory::format_bytes(total_), " in ",
                       host_pinned_.defined() ? "page-locked " : "", "host memory");
  return detail::cat(memory::format_bytes(total_), " in ", file_->file(),
                     file_->direct() ? " (O_DIRECT, io_uring)" : " (buffered, io_uring)", "; ",
                     buffers_.size(), " buffers of ", memory::format_bytes(largest_), " in memory");
}

}  // namespace loom::offload
