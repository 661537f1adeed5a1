// Cutting groups of tensors across ranks. See flat_layout.h.
#include "loom/sharding/flat_layout.h"

#include <algorithm>

#include "loom/error.h"

namespace loom::sharding {

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t FlatGroup::numel() const {
  int64_t n = 0;
  for (const auto& pieces : ranks)
    for (const auto& piece : pieces) n += piece.numel;
  return n;
}

int64_t cut_unit(const std::vector<int64_t>& shape, const Partitioning& partitioning) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  switch (partitioning.granularity) {
    case Granularity::element: return 1;
    case Granularity::block: return std::max<int64_t>(1, partitioning.block);
    case Granularity::row:
      return shape.empty() || shape[0] == 0 ? std::max<int64_t>(1, numel) : numel / shape[0];
    case Granularity::tensor: return std::max<int64_t>(1, numel);
  }
  return 1;
}

namespace {

struct Span {
  int64_t start, numel, unit;
};

// The largest allowed cut at or below `limit` (limit < total): inside the tensor that holds
// `limit`, the last unit boundary not past it.
int64_t cut_at_or_below(const std::vector<Span>& spans, int64_t limit) {
  auto it = std::upper_bound(spans.begin(), spans.end(), limit,
                             [](int64_t value, const Span& s) { return value < s.start; });
  const Span& s = *(it - 1);
  return s.start + (limit - s.start) / s.unit * s.unit;
}

// Rank boundaries for chunk size `chunk`, or empty when `world` chunks cannot hold the group.
std::vector<int64_t> greedy_cuts(const std::vector<Span>& spans, int64_t total, int64_t chunk,
                                 int world) {
  std::vector<int64_t> cuts{0};
  int64_t position = 0;
  for (int r = 0; r < world; ++r) {
    position = position + chunk >= total ? total : cut_at_or_below(spans, position + chunk);
    cuts.push_back(position);
  }
  if (position != total) return {};
  return cuts;
}

}  // namespace

FlatGroup plan_group(const std::vector<TensorInfo>& tensors, const std::vector<size_t>& members,
                     const Partitioning& partitioning, int world) {
  LOOM_INTERNAL_ASSERT(world >= 1 && !members.empty(), "plan_group needs ranks and tensors");
  std::vector<Span> spans;
  int64_t total = 0;
  for (size_t index : members) {
    const auto& t = tensors.at(index);
    spans.push_back({total, t.numel(), std::min(cut_unit(t.shape, partitioning),
                                                std::max<int64_t>(1, t.numel()))});
    total += t.numel();
  }
  // Feasibility is monotone in the chunk size (a larger chunk never ends a greedy cut earlier),
  // so binary search the smallest one between the even split and the whole group.
  int64_t low = std::max<int64_t>(1, (total + world - 1) / world), high = std::max<int64_t>(1, total);
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (greedy_cuts(spans, total, mid, world).empty()) low = mid + 1;
    else high = mid;
  }
  FlatGroup group;
  group.tensors = members;
  group.chunk = (low + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const auto cuts = greedy_cuts(spans, total, group.chunk, world);
  LOOM_INTERNAL_ASSERT(!cuts.empty(), "no cut of ", total, " elements into ", world,
                       " chunks of ", group.chunk);
  group.ranks.resize(world);
  for (int r = 0; r < world; ++r) {
    const int64_t begin = cuts[r], end = cuts[r + 1];
    for (size_t i = 0; i < spans.size(); ++i) {
      const int64_t a = std::max(begin, spans[i].start);
      const int64_t b = std::min(end, spans[i].start + spans[i].numel);
      if (a >= b) continue;
      group.ranks[r].push_back({members[i], a - spans[i].start, b - a, a - begin});
    }
  }
  return group;
}

std::vector<std::vector<size_t>> bucket_groups(const std::vector<TensorInfo>& tensors,
                                               int64_t bucket_bytes, int64_t bytes_per_element) {
  LOOM_CHECK_AS(ConfigError, bucket_bytes > 0, "the bucket size must be positive");
  std::vector<std::vector<size_t>> groups;
  int64_t filled = 0;
  for (size_t k = tensors.size(); k-- > 0;) {
    const int64_t bytes = tensors[k].numel() * bytes_per_element;
    if (groups.empty() || (!groups.back().empty() && filled + bytes > bucket_bytes)) {
      groups.emplace_back();
      filled = 0;
    }
    groups.back().push_back(k);
    filled += bytes;
  }
  for (auto& group : groups) std::reverse(group.begin(), group.end());
  return groups;
}

}  // namespace loom::sharding
