// CRC-32C (loom/crc32c.h): both paths against the published check values and against a
// bit-at-a-time reference written from the polynomial's definition, on every length 0..4096 at
// every start offset 0..7, and on lengths that reach the long interleaved streams.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "loom/crc32c.h"
#include "test_util.h"

namespace loom {
namespace {

// The definition, one bit at a time: reflected 0x1EDC6F41, ~0 in and out. Nothing shared with
// the implementation's tables or instructions.
uint32_t crc32c_bitwise(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

std::vector<Crc32cPath> paths_here() {
  std::vector<Crc32cPath> paths{Crc32cPath::software};
  if (crc32c_path() == Crc32cPath::sse42) paths.push_back(Crc32cPath::sse42);
  return paths;
}

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32c, PublishedCheckValues) {
  // The CRC catalogue's check value, and RFC 3720 (iSCSI) appendix B.4's 32-byte vectors.
  unsigned char zeros[32] = {}, ones[32], up[32], down[32];
  for (int i = 0; i < 32; ++i) {
    ones[i] = 0xFF;
    up[i] = static_cast<unsigned char>(i);
    down[i] = static_cast<unsigned char>(31 - i);
  }
  for (const Crc32cPath path : paths_here()) {
    SCOPED_TRACE(crc32c_path_name(path));
    EXPECT_EQ(crc32c_with(path, "123456789", 9), 0xE3069283u);
    EXPECT_EQ(crc32c_with(path, zeros, 32), 0x8A9136AAu);
    EXPECT_EQ(crc32c_with(path, ones, 32), 0x62A8AB43u);
    EXPECT_EQ(crc32c_with(path, up, 32), 0x46DD794Eu);
    EXPECT_EQ(crc32c_with(path, down, 32), 0x113FDB5Cu);
    EXPECT_EQ(crc32c_with(path, nullptr, 0), 0u);
  }
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
}

TEST(Crc32c, EveryLengthAndStartMatchesTheDefinition) {
  std::cout << "CRC-32C path on this CPU: " << crc32c_path_name(crc32c_path()) << "\n";
  const auto data = random_bytes(4096 + 8, 1);
  for (size_t start = 0; start < 8; ++start)
    for (size_t n = 0; n <= 4096; ++n) {
      const uint32_t want = crc32c_bitwise(data.data() + start, n);
      for (const Crc32cPath path : paths_here())
        ASSERT_EQ(crc32c_with(path, data.data() + start, n), want)
            << crc32c_path_name(path) << ", " << n << " bytes from offset " << start;
    }
}

TEST(Crc32c, LongBuffersAndContinuationsMatchTheDefinition) {
  // From 8 KiB the fast path folds beside its crc32 streams in 8 KiB rounds, the rest in rounds
  // of three 256-byte streams: around each boundary of both, and a 1 MiB piece as the swap file
  // checks.
  const auto data = random_bytes((1 << 20) + 64, 2);
  std::vector<size_t> lengths{767,  768,  769,  8191, 8192, 8193, 8192 + 767, 8192 + 768,
                              16384 + 768 + 9, size_t{1} << 20, (size_t{1} << 20) + 61};
  for (const size_t n : lengths)
    for (const size_t start : {size_t{0}, size_t{3}}) {
      const uint32_t want = crc32c_bitwise(data.data() + start, n);
      for (const Crc32cPath path : paths_here()) {
        ASSERT_EQ(crc32c_with(path, data.data() + start, n), want)
            << crc32c_path_name(path) << ", " << n << " bytes from offset " << start;
        // Continued at any split, as a stream is checked piece by piece.
        for (const size_t split : {size_t{1}, n / 3, n - 1}) {
          if (split > n) continue;
          const uint32_t first = crc32c_with(path, data.data() + start, split);
          ASSERT_EQ(crc32c_with(path, data.data() + start + split, n - split, first), want)
              << crc32c_path_name(path) << ", " << n << " bytes split at " << split;
        }
      }
    }
}

TEST(Crc32c, ThePathThisCpuLacksIsAnError) {
  if (crc32c_path() == Crc32cPath::sse42) GTEST_SKIP() << "this CPU has SSE4.2 and PCLMULQDQ";
  EXPECT_THROW_WITH(crc32c_with(Crc32cPath::sse42, "x", 1), Error, "'sse42' needs",
                    "use the software path");
}

}  // namespace
}  // namespace loom
