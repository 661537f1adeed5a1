// CRC-32C's two paths and the choice between them: Note [CRC-32C paths] in app/loom/crc32c.h.
// Torch-free (the fuzz build compiles it with clang too).
#include "loom/crc32c.h"

#include <array>
#include <cstring>

#include "loom/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // 0x1EDC6F41 reflected

// slice[k][b]: the CRC state after byte b followed by k zero bytes, from state 0.
using SliceTables = std::array<std::array<uint32_t, 256>, 8>;
constexpr SliceTables make_slice_tables() {
  SliceTables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  return t;
}
constexpr SliceTables kSlice = make_slice_tables();

uint64_t load64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// The state (not inverted) over n bytes.
uint32_t extend_software(uint32_t state, const unsigned char* p, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t w = load64(p) ^ state;
    const auto lo = static_cast<uint32_t>(w), hi = static_cast<uint32_t>(w >> 32);
    state = kSlice[7][lo & 0xFF] ^ kSlice[6][(lo >> 8) & 0xFF] ^ kSlice[5][(lo >> 16) & 0xFF] ^
            kSlice[4][lo >> 24] ^ kSlice[3][hi & 0xFF] ^ kSlice[2][(hi >> 8) & 0xFF] ^
            kSlice[1][(hi >> 16) & 0xFF] ^ kSlice[0][hi >> 24];
  }
#endif
  for (; n > 0; --n, ++p) state = kSlice[0][(state ^ *p) & 0xFF] ^ (state >> 8);
  return state;
}

#if defined(__x86_64__)

// x^n mod P in the reflected representation (bit 31 is x^0): the factor that moves a CRC state
// past n zero bits.
constexpr uint32_t x_to_the(uint32_t n) {
  uint32_t r = 0x80000000u;
  for (; n > 0; --n) r = (r & 1) ? (r >> 1) ^ kPolynomial : r >> 1;
  return r;
}

// Note [Joining interleaved CRCs]: the state is linear in what came before, so with a, b, c
// the states of three consecutive L-byte streams (a from the running state, b and c from 0),
// the state after all three is a·x^(16L) + b·x^(8L) + c (mod P). PCLMULQDQ multiplies two
// reflected 32-bit values into a 64-bit one whose reflected reading is their product times x,
// and crc32 of that word from 0 reduces it mod P times x^32: so the constant for "times
// x^(8n)" is x^(8n-33).
__attribute__((target("sse4.2,pclmul"))) inline uint32_t times(uint32_t state, uint32_t factor) {
  const __m128i product =
      _mm_clmulepi64_si128(_mm_cvtsi32_si128(static_cast<int>(state)),
                           _mm_cvtsi32_si128(static_cast<int>(factor)), 0x00);
  return static_cast<uint32_t>(_mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(product))));
}

template <size_t kStream>
struct Interleave {
  static constexpr uint32_t kOnce = x_to_the(8 * kStream - 33);
  static constexpr uint32_t kTwice = x_to_the(16 * kStream - 33);

  __attribute__((target("sse4.2,pclmul"))) static uint32_t run(uint32_t state,
                                                               const unsigned char*& p,
                                                               size_t& n) {
    for (; n >= 3 * kStream; n -= 3 * kStream, p += 3 * kStream) {
      uint64_t a = state, b = 0, c = 0;
      for (size_t i = 0; i < kStream; i += 8) {
        a = _mm_crc32_u64(a, load64(p + i));
        b = _mm_crc32_u64(b, load64(p + kStream + i));
        c = _mm_crc32_u64(c, load64(p + 2 * kStream + i));
      }
      state = times(static_cast<uint32_t>(a), kTwice) ^ times(static_cast<uint32_t>(b), kOnce) ^
              static_cast<uint32_t>(c);
    }
    return state;
  }
};

// Note [Folding beside crc32]: the crc32 instruction issues on one execution port, PCLMULQDQ on
// another, so a round does both at once: its first 4·kStream bytes are folded 64 at a time in
// four 128-bit accumulators (each holds 16 message bytes congruent, mod P, to all it has
// absorbed: its low half L (earlier bytes) and high half H moved 64 bytes on are L·x^576 and
// H·x^512, two multiplies by x^(576-33) and x^(512-33), as in Note [Joining interleaved CRCs]),
// while crc32 runs four streams over the next 4·kStream bytes. At the round's end the
// accumulators fold into one 16-byte value, whose CRC from 0 (two crc32) is the folded part's
// state, and that and the streams join as in Note [Joining interleaved CRCs]. Each accumulator
// starts from its first 16 bytes, the running state XORed into the first 4 (a CRC from state s
// equals one from 0 over the message with s XORed into its first 32 bits).
template <size_t kStream>
struct FoldBesideCrc {
  static constexpr size_t kFold = 4 * kStream, kRound = 8 * kStream;
  __attribute__((target("sse4.2,pclmul"))) static uint32_t run(uint32_t state,
                                                               const unsigned char*& p,
                                                               size_t& n) {
    static_assert(kStream % 16 == 0, "streams of whole 16-byte steps");
    constexpr uint32_t kStep[2] = {x_to_the(543), x_to_the(479)};  // past 64 bytes: L, H
    // Accumulators 0-2 moved past the 48, 32 and 16 bytes after their last block, onto the 4th.
    constexpr uint32_t kJoin[3][2] = {{x_to_the(415), x_to_the(351)},
                                      {x_to_the(287), x_to_the(223)},
                                      {x_to_the(159), x_to_the(95)}};
    // The folded part and streams 0-2 moved past the 4, 3, 2 and 1 streams after them.
    constexpr uint32_t kShift[4] = {x_to_the(8 * 4 * kStream - 33), x_to_the(8 * 3 * kStream - 33),
                                    x_to_the(8 * 2 * kStream - 33), x_to_the(8 * kStream - 33)};
    const __m128i step = _mm_set_epi64x(kStep[1], kStep[0]);
    for (; n >= kRound; n -= kRound, p += kRound) {
      const unsigned char* f = p;
      const unsigned char* c = p + kFold;
      __m128i a[4];
      for (int j = 0; j < 4; ++j)
        a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f + 16 * j));
      a[0] = _mm_xor_si128(a[0], _mm_cvtsi32_si128(static_cast<int>(state)));
      uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
      for (size_t i = 0; i < kStream; i += 16) {
        b0 = _mm_crc32_u64(b0, load64(c + i));
        b1 = _mm_crc32_u64(b1, load64(c + kStream + i));
        b2 = _mm_crc32_u64(b2, load64(c + 2 * kStream + i));
        b3 = _mm_crc32_u64(b3, load64(c + 3 * kStream + i));
        b0 = _mm_crc32_u64(b0, load64(c + i + 8));
        b1 = _mm_crc32_u64(b1, load64(c + kStream + i + 8));
        b2 = _mm_crc32_u64(b2, load64(c + 2 * kStream + i + 8));
        b3 = _mm_crc32_u64(b3, load64(c + 3 * kStream + i + 8));
        if (i + 16 < kStream) {
          const unsigned char* next = f + 4 * (i + 16);
          for (int j = 0; j < 4; ++j)
            a[j] = _mm_xor_si128(
                _mm_xor_si128(_mm_clmulepi64_si128(a[j], step, 0x00),
                              _mm_clmulepi64_si128(a[j], step, 0x11)),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(next + 16 * j)));
        }
      }
      __m128i v = a[3];
      for (int j = 0; j < 3; ++j) {
        const __m128i k = _mm_set_epi64x(kJoin[j][1], kJoin[j][0]);
        v = _mm_xor_si128(v, _mm_xor_si128(_mm_clmulepi64_si128(a[j], k, 0x00),
                                           _mm_clmulepi64_si128(a[j], k, 0x11)));
      }
      uint64_t folded = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(v)));
      folded = _mm_crc32_u64(folded, static_cast<uint64_t>(_mm_extract_epi64(v, 1)));
      state = times(static_cast<uint32_t>(folded), kShift[0]) ^
              times(static_cast<uint32_t>(b0), kShift[1]) ^
              times(static_cast<uint32_t>(b1), kShift[2]) ^
              times(static_cast<uint32_t>(b2), kShift[3]) ^ static_cast<uint32_t>(b3);
    }
    return state;
  }
};

__attribute__((target("sse4.2,pclmul"))) uint32_t extend_sse42(uint32_t state,
                                                               const unsigned char* p, size_t n) {
  // 8 KiB rounds of folding beside crc32 where the data is long (the joins' ~40 cycles spread
  // over 8 KiB), three crc32 streams of 256 bytes for what remains; then words and bytes.
  state = FoldBesideCrc<1024>::run(state, p, n);
  state = Interleave<256>::run(state, p, n);
  uint64_t s = state;
  for (; n >= 8; n -= 8, p += 8) s = _mm_crc32_u64(s, load64(p));
  state = static_cast<uint32_t>(s);
  for (; n > 0; --n, ++p) state = _mm_crc32_u8(state, *p);
  return state;
}

bool cpu_has_sse42() {
  static const bool has = [] {
    __builtin_cpu_init();  // in case the first CRC runs in a static initialiser
    return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
  }();
  return has;
}

#else

bool cpu_has_sse42() { return false; }

#endif

uint32_t run_path(Crc32cPath path, const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (path == Crc32cPath::sse42) return ~extend_sse42(~crc, p, size);
#endif
  (void)path;
  return ~extend_software(~crc, p, size);
}

}  // namespace

Crc32cPath crc32c_path() { return cpu_has_sse42() ? Crc32cPath::sse42 : Crc32cPath::software; }

const char* crc32c_path_name(Crc32cPath path) {
  return path == Crc32cPath::sse42 ? "sse42" : "software";
}

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  return run_path(crc32c_path(), data, size, crc);
}

uint32_t crc32c_with(Crc32cPath path, const void* data, size_t size, uint32_t crc) {
  LOOM_CHECK(path != Crc32cPath::sse42 || cpu_has_sse42(),
             "the CRC-32C path 'sse42' needs an x86-64 CPU with SSE4.2 and PCLMULQDQ, which this "
             "one is not; use the software path");
  return run_path(path, data, size, crc);
}

}  // namespace loom
