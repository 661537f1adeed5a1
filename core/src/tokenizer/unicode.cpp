#include "tokenizer/unicode.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <stdexcept>

namespace loom::tok {

char32_t next_code_point(std::string_view s, size_t i, size_t* length) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  *length = 1;
  if (b0 < 0x80) return b0;
  int n;
  char32_t c;
  char32_t min;
  if ((b0 & 0xE0) == 0xC0) n = 2, c = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0) n = 3, c = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0) n = 4, c = b0 & 0x07, min = 0x10000;
  else return 0xFFFD;
  if (i + n > s.size()) return 0xFFFD;
  for (int k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0xFFFD;
    c = (c << 6) | (b & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0xFFFD;
  *length = static_cast<size_t>(n);
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      out.push_back(static_cast<char>(b0));
      ++i;
      continue;
    }
    // Unicode's "maximal subpart" rule: the second byte's valid range depends on the first.
    int n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) n = 2;
    else if (b0 == 0xE0) n = 3, lo = 0xA0;
    else if (b0 >= 0xE1 && b0 <= 0xEC) n = 3;
    else if (b0 == 0xED) n = 3, hi = 0x9F;
    else if (b0 >= 0xEE && b0 <= 0xEF) n = 3;
    else if (b0 == 0xF0) n = 4, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3) n = 4;
    else if (b0 == 0xF4) n = 4, hi = 0x8F;
    size_t k = 1;
    bool ok = n > 0;
    for (; ok && k < static_cast<size_t>(n); ++k) {
      if (i + k >= s.size()) { ok = false; break; }
      const auto b = static_cast<unsigned char>(s[i + k]);
      const bool in_range = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      if (!in_range) { ok = false; break; }
    }
    if (ok) {
      out.append(s.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      out.append("\xEF\xBF\xBD");
      i += n > 0 ? k : 1;
    }
  }
  return out;
}

bool is_letter(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_L_MASK) != 0;
}
bool is_number(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_N_MASK) != 0;
}
bool is_white_space(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)); }
bool is_punctuation(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_P_MASK) != 0;
}
bool is_other(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_C_MASK) != 0;
}
bool is_nonspacing_mark(char32_t c) { return u_charType(static_cast<UChar32>(c)) == U_NON_SPACING_MARK; }

std::string normalize(std::string_view s, NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = nullptr;
  switch (form) {
    case NormalForm::NFC: normalizer = icu::Normalizer2::getNFCInstance(status); break;
    case NormalForm::NFD: normalizer = icu::Normalizer2::getNFDInstance(status); break;
    case NormalForm::NFKC: normalizer = icu::Normalizer2::getNFKCInstance(status); break;
    case NormalForm::NFKD: normalizer = icu::Normalizer2::getNFKDInstance(status); break;
  }
  if (U_FAILURE(status)) throw std::runtime_error("ICU has no normalizer");
  const auto text = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  // Already-normal text (nearly all of it) skips the copy.
  if (normalizer->isNormalized(text, status) && U_SUCCESS(status)) return std::string(s);
  status = U_ZERO_ERROR;
  const icu::UnicodeString result = normalizer->normalize(text, status);
  if (U_FAILURE(status)) throw std::runtime_error("ICU normalization failed");
  std::string out;
  result.toUTF8String(out);
  return out;
}

// Code point by code point, as Rust's char::to_lowercase (and so `tokenizers`) does: no
// context, so a word-final capital sigma becomes σ, not ς. The one unconditional mapping to
// more than one code point is U+0130 (İ -> i + combining dot above).
std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      out.push_back(b >= 'A' && b <= 'Z' ? static_cast<char>(b - 'A' + 'a') : static_cast<char>(b));
      ++i;
      continue;
    }
    size_t n;
    const char32_t c = next_code_point(s, i, &n);
    i += n;
    if (c == 0x130) {
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, static_cast<char32_t>(u_tolower(static_cast<UChar32>(c))));
  }
  return out;
}

}  // namespace loom::tok
