// loom::Tokenizer's encode speed on one thread: every document of a JSONL file ({"text": ...}
// per line) encoded with the tokenizer's specials, `rounds` times; prints one JSON line per
// round (seconds, bytes, ids) and the id count, which run.py checks against the tokenizers
// package's so the two encoded the same thing.
//   loom_bench_tokenizer TOKENIZER_DIR DOCS.jsonl ROUNDS
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: loom_bench_tokenizer TOKENIZER_DIR DOCS.jsonl ROUNDS\n");
    return 2;
  }
  const auto tokenizer = loom::Tokenizer::load(argv[1]);
  std::vector<std::string> docs;
  size_t bytes = 0;
  std::ifstream in(argv[2]);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    docs.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
    bytes += docs.back().size();
  }
  const int rounds = std::stoi(argv[3]);
  for (int r = 0; r < rounds; ++r) {
    size_t ids = 0;
    const auto start = std::chrono::steady_clock::now();
    for (const auto& doc : docs) ids += tokenizer->encode(doc).ids.size();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("{\"seconds\": %.6f, \"bytes\": %zu, \"ids\": %zu}\n", seconds, bytes, ids);
  }
  return 0;
}
