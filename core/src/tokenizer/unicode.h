// UTF-8 walking and the Unicode facts the tokenizers need (categories, normal forms, case),
// all from ICU: no hand-made tables.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace loom::tok {

// The code point at s[i] and its length in bytes; malformed input yields U+FFFD, length 1.
char32_t next_code_point(std::string_view s, size_t i, size_t* length);
void append_utf8(std::string& out, char32_t c);
// Bytes to text as Rust's String::from_utf8_lossy does: each maximal ill-formed subsequence
// becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

bool is_letter(char32_t c);       // \p{L}
bool is_number(char32_t c);       // \p{N}
bool is_white_space(char32_t c);  // the White_Space property (Rust's char::is_whitespace)
bool is_punctuation(char32_t c);  // \p{P}
bool is_other(char32_t c);        // \p{C}: Cc Cf Cs Co Cn
bool is_nonspacing_mark(char32_t c);  // Mn

enum class NormalForm { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, NormalForm form);
std::string lowercase(std::string_view s);  // per code point, as Rust's char::to_lowercase

}  // namespace loom::tok
