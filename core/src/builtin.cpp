// The core's built-in plugin: the data sources random_tokens, text and tokens, and the AdamW
// update rule (a fused CPU kernel plus a tensor-op path for other devices).
#include "builtin.h"

#include "adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>
#include <sstream>
#include <thread>

#include "loom/data.h"
#include "loom/engine.h"
#include "loom/error.h"
#include "loom/hf_config.h"
#include "loom/log.h"
#include "loom/update_rule.h"

namespace loom {
namespace {

// Stand-in for per-sample preparation work (I/O, decoding, tokenising) in benchmarks: it
// sleeps, as waiting on a disk or a decoder off the compute cores would.
void simulate_preparation(double microseconds) {
  if (microseconds > 0)
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(microseconds));
}

// A generator for sample `index`, independent of order and thread.
at::Generator sample_generator(uint64_t seed, int64_t index) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(index) + 0x632BE59BD9B4E019ull);
  s ^= s >> 31;
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

// Note [One resolved job]: each source's checks, made by its validate() (`loom check` and
// `loom run` alike, before anything is built) and again by the dataset itself.
void check_random_tokens(const ConfigSection& c) {
  const double cost = c.get_float("sample_cost_us");
  const double ignore_fraction = c.get_float("ignore_label_fraction");
  const int64_t low = c.get_int("vocab_low"), high = c.get_int("vocab_high");
  LOOM_CHECK_AS(ConfigError, cost >= 0, c.where("sample_cost_us"),
                ": [data] sample_cost_us must be >= 0, got ", cost);
  LOOM_CHECK_AS(ConfigError, ignore_fraction >= 0 && ignore_fraction < 1,
                c.where("ignore_label_fraction"),
                ": [data] ignore_label_fraction must be in [0, 1), got ", ignore_fraction);
  LOOM_CHECK_AS(ConfigError, c.get_int("num_samples") > 0 && c.get_int("seq_len") > 0,
                c.where("num_samples"), ": [data] num_samples and seq_len must be positive");
  LOOM_CHECK_AS(ConfigError, 0 <= low && low < high, c.where("vocab_low"),
                ": [data] needs 0 <= vocab_low < vocab_high, got ", low, " and ", high);
  const auto task = c.get_string("task");
  LOOM_CHECK_AS(ConfigError, task == "lm" || task == "classification", c.where("task"),
                ": [data] task must be \"classification\" or \"lm\", not \"", task, "\"");
  LOOM_CHECK_AS(ConfigError, c.get_int("num_labels") >= 1, c.where("num_labels"),
                ": [data] num_labels must be at least 1");
}

// Note [Data against the model]: a token id at or above the model's vocabulary, or a label at or
// above its classes, used to pass every check and fail at the first forward, after output_dir
// held run.json and an empty metrics.jsonl; so each data source checks its data against the
// model in validate() (`loom check` and `loom run` alike, before anything is built or written).
// The limits are the model's as the job states them, in transformers' names, which every model
// table and every config.json uses: `vocab_size` and `num_labels` of the [model] table, or of
// its from_pretrained folder's config.json (num_labels there: the size of id2label, as
// transformers counts), read for every data source, the datasets plugin's too, by
// pretrained::model_limit (loom/hf_config.h). A model that states neither (a test plugin's)
// gets no check. A full pass over a file costs a read of it; past kFullScanBytes, the cost of
// reading far more data than a run of most jobs trains on, a sample of evenly spread stripes is
// read instead, and one info line says so (an id outside it is still refused by the model's own
// check at its forward).
using pretrained::ModelLimit;
ModelLimit model_limit(const Plugin::JobTables& job, const char* key) {
  return pretrained::model_limit(job("model"), job.resolve_path, key);
}

constexpr int64_t kFullScanBytes = int64_t{256} << 20;
constexpr int64_t kSampleStripes = 64;

// Note [Data against the model]: the ids of a file (`width`-byte little-endian ids: 1 for
// text's bytes, 2 or 4 for tokens) checked below `vocab`, all of them or a sample.
void check_file_ids(const ConfigSection& c, const std::string& path, const std::string& shown,
                    int width, const ModelLimit& vocab, const std::string& what_to_do) {
  if (vocab.value <= 0 || (width == 1 && vocab.value >= 256) ||
      (width == 2 && vocab.value >= 65536))
    return;  // every id the file can hold is below it
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // refused by the caller's own checks
  struct stat st {};
  ::fstat(fd, &st);
  const int64_t bytes = static_cast<int64_t>(st.st_size), ids = bytes / width;
  if (ids == 0) {
    ::close(fd);
    return;
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  LOOM_CHECK_AS(DataError, map != MAP_FAILED, "cannot map '", path, "': ", std::strerror(errno));
  const auto* data = static_cast<const unsigned char*>(map);
  auto id_at = [&](int64_t i) -> int64_t {
    if (width == 1) return data[i];
    if (width == 2) {
      uint16_t v;
      std::memcpy(&v, data + i * 2, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, data + i * 4, 4);
    return v;
  };
  // [begin, end) of the ids: the first at or above the vocabulary, or -1.
  auto first_outside = [&](int64_t begin, int64_t end) -> int64_t {
    constexpr int64_t kBlock = 1 << 16;
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t e = std::min(end, b + kBlock);
      int64_t most = 0;
      for (int64_t i = b; i < e; ++i) most = std::max(most, id_at(i));  // vectorises
      if (most < vocab.value) continue;
      for (int64_t i = b; i < e; ++i)
        if (id_at(i) >= vocab.value) return i;
    }
    return -1;
  };
  const bool sample = bytes > kFullScanBytes;
  ::madvise(map, static_cast<size_t>(bytes), sample ? MADV_RANDOM : MADV_SEQUENTIAL);
  int64_t bad = -1, checked = 0;
  if (!sample) {
    bad = first_outside(0, ids);
    checked = ids;
  } else {
    // Stripes from the first id to the last, evenly spaced.
    const int64_t stripe = kFullScanBytes / kSampleStripes / width;
    for (int64_t s = 0; s < kSampleStripes && bad < 0; ++s) {
      const int64_t begin = (ids - stripe) * s / (kSampleStripes - 1);
      bad = first_outside(begin, begin + stripe);
      checked += stripe;
    }
  }
  const int64_t value = bad >= 0 ? id_at(bad) : 0;
  ::munmap(map, static_cast<size_t>(bytes));
  LOOM_CHECK_AS(DataError, bad < 0, c.where("path"), ": [", c.name(), "] path '", shown,
                "': token id ", value,
                " at position ", bad, " (byte ", bad * width, ") of '", path,
                "' is not below the model's vocabulary of ", vocab.value, " ids (",
                vocab.source, "); ", what_to_do);
  if (sample)
    log::info("[", c.name(), "] '", path, "': token ids checked below ", vocab.value, " in a sample of ",
              checked, " of its ", ids, " ids (", kSampleStripes, " stripes of ",
              kFullScanBytes / kSampleStripes / (1 << 20), " MiB; a full pass reads ",
              bytes / (1 << 20), " MiB); the model's forward checks the rest");
}

// A file of a source's list with no bytes: a shard that was never written, most often.
void check_not_empty(const ConfigSection& c, const std::string& path, const std::string& shown) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  LOOM_CHECK_AS(DataError, ec || size > 0, c.where("path"), ": [", c.name(), "] path '", shown,
                "': '", path,
                "' is empty (0 bytes): nothing to train on; remove it from path, or write the "
                "data again (an interrupted download or preparation leaves empty files)");
}

// Enough tokens for one window of seq_len + 1.
void check_windows(int64_t total, int64_t seq_len, const std::string& what) {
  LOOM_CHECK_AS(DataError, seq_len > 0, "[data] seq_len must be positive");
  LOOM_CHECK_AS(DataError, total > seq_len, what, " has ", total, " tokens: too few for one sample ",
                "of seq_len ", seq_len, " (+1); use a bigger file or a smaller seq_len");
}

using PathResolver = std::function<std::string(const std::string&)>;

// The text source's files, each readable, by their resolved paths.
std::vector<std::string> text_files(const ConfigSection& c, const PathResolver& resolve) {
  std::vector<std::string> files;
  for (const auto& raw : c.get_strings("path")) {
    const std::string path = resolve(raw);
    LOOM_CHECK_AS(DataError, std::ifstream(path, std::ios::binary).good(), c.where("path"),
                  ": [data] path '", raw, "': cannot read '", path,
                  "' (missing or unreadable); point path at a text file");
    files.push_back(path);
  }
  LOOM_CHECK_AS(ConfigError, !files.empty(), c.where("path"),
                ": [data] source = \"text\" needs path = \"file.txt\" (or a list of files)");
  return files;
}

// The tokens source's one file (resolved) and its id width in bytes.
std::pair<std::string, int> tokens_file(const ConfigSection& c, const PathResolver& resolve) {
  const auto raw = c.get_strings("path");
  LOOM_CHECK_AS(ConfigError, raw.size() == 1, c.where("path"),
                ": [data] source = \"tokens\" needs one path = \"file.bin\"");
  const std::string dtype = c.get_string("dtype");
  LOOM_CHECK_AS(ConfigError, dtype == "uint16" || dtype == "uint32", c.where("dtype"),
                ": [data] dtype must be \"uint16\" or \"uint32\", not \"", dtype, "\"");
  return {resolve(raw.front()), dtype == "uint16" ? 2 : 4};
}

void check_token_bytes(const std::string& path, size_t bytes, int width, const std::string& dtype) {
  LOOM_CHECK_AS(DataError, bytes % width == 0, "'", path, "' has ", bytes,
                " bytes, not a multiple of ", width, " (", dtype, "); is [data] dtype right?");
}

// The benchmark's dummy data: ids uniform in [low, high), a binary (num_labels) label per
// sample, or next-token labels for language models.
class RandomTokens final : public Dataset {
 public:
  RandomTokens(const ConfigSection& c, uint64_t seed)
      : samples_(c.get_int("num_samples")), seq_len_(c.get_int("seq_len")),
        low_(c.get_int("vocab_low")), high_(c.get_int("vocab_high")),
        labels_(c.get_int("num_labels")), lm_(c.get_string("task") == "lm"),
        ignore_fraction_(c.get_float("ignore_label_fraction")),
        cost_(c.get_float("sample_cost_us")), seed_(seed) {
    check_random_tokens(c);
  }
  int64_t size() const override { return samples_; }
  Sample get(int64_t index) const override {
    simulate_preparation(cost_);
    auto generator = sample_generator(seed_, index);
    Sample s;
    s.index = index;
    if (lm_) {
      at::Tensor ids = at::randint(low_, high_, {seq_len_ + 1}, generator, at::kLong);
      s.input_ids = ids.slice(0, 0, seq_len_).clone();
      s.labels = ids.slice(0, 1, seq_len_ + 1).clone();
      if (ignore_fraction_ > 0) {
        // Documents of different lengths: up to that fraction of trailing labels is padding.
        const auto most = static_cast<int64_t>(ignore_fraction_ * static_cast<double>(seq_len_));
        const int64_t padded = at::randint(0, most + 1, {}, generator, at::kLong).item<int64_t>();
        if (padded > 0) s.labels.slice(0, seq_len_ - padded).fill_(kIgnoreIndex);
      }
    } else {
      s.input_ids = at::randint(low_, high_, {seq_len_}, generator, at::kLong);
      s.labels = at::randint(0, labels_, {}, generator, at::kLong);
    }
    return s;
  }
  std::string describe() const override {
    return detail::cat("random_tokens(", samples_, " samples x ", seq_len_, " ids in [", low_,
                       ", ", high_, "), ", lm_ ? "next-token labels" : "class labels", ")");
  }

 private:
  int64_t samples_, seq_len_, low_, high_, labels_;
  bool lm_;
  double ignore_fraction_, cost_;
  uint64_t seed_;
};

// Windows of seq_len+1 tokens over a token stream: input = window[:-1], labels = window[1:].
class WindowedTokens : public Dataset {
 public:
  int64_t size() const override {
    return total_ <= seq_len_ ? 0 : (total_ - seq_len_ - 1) / stride_ + 1;
  }
  Sample get(int64_t index) const override {
    LOOM_INTERNAL_ASSERT(index >= 0 && index < size(), "sample index ", index, " out of range");
    at::Tensor window = at::empty({seq_len_ + 1}, at::kLong);
    int64_t* out = window.data_ptr<int64_t>();
    const int64_t start = index * stride_;
    for (int64_t i = 0; i <= seq_len_; ++i) out[i] = token(start + i);
    Sample s;
    s.index = index;
    s.input_ids = window.slice(0, 0, seq_len_).clone();
    s.labels = window.slice(0, 1, seq_len_ + 1).clone();
    return s;
  }

 protected:
  void init(int64_t total, int64_t seq_len, int64_t stride, const std::string& what) {
    total_ = total;
    seq_len_ = seq_len;
    stride_ = stride > 0 ? stride : seq_len;
    check_windows(total, seq_len, what);
  }
  virtual int64_t token(int64_t i) const = 0;
  int64_t total_ = 0, seq_len_ = 0, stride_ = 0;
};

// Byte-level tokens (ids 0..255) of one or more text files.
class TextBytes final : public WindowedTokens {
 public:
  TextBytes(const ConfigSection& c, Engine& engine) {
    files_ = text_files(c, [&](const std::string& p) { return engine.resolve_path(p); });
    for (const auto& path : files_) {
      std::ifstream in(path, std::ios::binary);
      std::stringstream buffer;
      buffer << in.rdbuf();
      bytes_ += buffer.str();
    }
    init(static_cast<int64_t>(bytes_.size()), c.get_int("seq_len"), c.get_int("stride"),
         "the text");
  }
  std::string describe() const override {
    return detail::cat("text(", files_.size(), " file(s), ", bytes_.size(), " bytes, ", size(),
                       " windows of ", seq_len_, ")");
  }

 private:
  int64_t token(int64_t i) const override { return static_cast<unsigned char>(bytes_[i]); }
  std::string bytes_;
  std::vector<std::string> files_;
};

// A flat binary file of uint16 or uint32 token ids, memory-mapped.
class MappedTokens final : public WindowedTokens {
 public:
  MappedTokens(const ConfigSection& c, Engine& engine) {
    const auto raw = c.get_strings("path");
    std::tie(path_, width_) =
        tokens_file(c, [&](const std::string& p) { return engine.resolve_path(p); });
    const std::string dtype = c.get_string("dtype");
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    LOOM_CHECK_AS(DataError, fd >= 0, c.where("path"), ": [data] path '", raw.front(),
                  "': cannot open '", path_, "': ", std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    bytes_ = static_cast<size_t>(st.st_size);
    if (bytes_ > 0) {
      map_ = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
      ::close(fd);
      LOOM_CHECK_AS(DataError, map_ != MAP_FAILED, "cannot map '", path_, "': ",
                    std::strerror(errno));
    } else {
      ::close(fd);
    }
    check_token_bytes(path_, bytes_, width_, dtype);
    init(static_cast<int64_t>(bytes_ / width_), c.get_int("seq_len"), c.get_int("stride"),
         "'" + path_ + "'");
  }
  ~MappedTokens() override {
    if (map_ && map_ != MAP_FAILED) ::munmap(map_, bytes_);
  }
  std::string describe() const override {
    return detail::cat("tokens(", path_, ", ", total_, " ids of ", width_ * 8, " bits, ",
                       size(), " windows of ", seq_len_, ")");
  }

 private:
  int64_t token(int64_t i) const override {
    if (width_ == 2) {
      uint16_t v;
      std::memcpy(&v, static_cast<const char*>(map_) + i * 2, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, static_cast<const char*>(map_) + i * 4, 4);
    return v;
  }
  std::string path_;
  void* map_ = nullptr;
  size_t bytes_ = 0;
  int width_ = 2;
};

class CorePlugin final : public Plugin {
 public:
  std::string name() const override { return "core"; }
  std::string description() const override {
    return "built into libloom_core: data sources random_tokens, text, tokens; optimizer adamw";
  }
  std::vector<Schema> schemas() const override {
    Schema random("data", "random_tokens");
    random.key_int("num_samples", 512, "samples in the dataset")
        .key_int("seq_len", 128, "tokens per sample")
        .key_int("vocab_low", 100, "smallest token id drawn")
        .key_int("vocab_high", 30000, "token ids are drawn below this")
        .key_int("num_labels", 2, "classes of the per-sample label")
        .key_string("task", "classification",
                    "classification (one label per sample) | lm (next-token labels)")
        .key_float("ignore_label_fraction", 0.0,
                   "lm only: up to this fraction of each sample's trailing labels is padding")
        .key_float("sample_cost_us", 0.0,
                   "simulated preparation time per sample in microseconds (a sleep standing "
                   "in for reading/decoding/tokenising), for preloading benchmarks");
    Schema text("data", "text");
    text.key_required("path", ValueType::Any, "text file(s), relative to the job file")
        .key_int("seq_len", 128, "tokens (bytes) per sample")
        .key_int("stride", 0, "tokens between sample starts (0 = seq_len)");
    Schema tokens("data", "tokens");
    tokens.key_required("path", ValueType::String, "flat binary file of token ids")
        .key_string("dtype", "uint16", "uint16 | uint32")
        .key_int("seq_len", 128, "tokens per sample")
        .key_int("stride", 0, "tokens between sample starts (0 = seq_len)");
    Schema adamw("optimizer", "adamw");
    adamw.key_float("beta1", 0.9, "first-moment decay")
        .key_float("beta2", 0.999, "second-moment decay")
        .key_float("eps", 1e-8, "added to the denominator")
        .key_float("weight_decay", 0.0, "decoupled weight decay (not applied to biases/norms)");
    return {random, text, tokens, adamw};
  }
  // Note [One resolved job]: the sources' files exist and hold at least one sample; the
  // numbers are in range. Reads no data (a file's size, not its bytes).
  void validate(const std::string& name, const ConfigSection& c,
                const JobTables& job) const override {
    // Note [Data against the model].
    const ModelLimit vocab = model_limit(job, "vocab_size");
    if (name == "random_tokens") {
      check_random_tokens(c);
      LOOM_CHECK_AS(ConfigError, vocab.value <= 0 || c.get_int("vocab_high") <= vocab.value,
                    c.where("vocab_high"), ": [", c.name(), "] vocab_high = ",
                    c.get_int("vocab_high"), " draws token ids up to ", c.get_int("vocab_high") - 1,
                    ", not below the model's vocabulary of ", vocab.value, " ids (", vocab.source,
                    "); set vocab_high <= ", vocab.value);
      const ModelLimit labels = model_limit(job, "num_labels");
      LOOM_CHECK_AS(ConfigError,
                    c.get_string("task") != "classification" || labels.value <= 0 ||
                        c.get_int("num_labels") <= labels.value,
                    c.where("num_labels"), ": [", c.name(), "] num_labels = ",
                    c.get_int("num_labels"), " draws labels up to ", c.get_int("num_labels") - 1,
                    ", but the model has ", labels.value, " classes (", labels.source,
                    "); set num_labels <= ", labels.value, " or give the model more classes");
    }
    if (name == "text") {
      int64_t bytes = 0;
      const auto raw = c.get_strings("path");
      const auto files = text_files(c, job.resolve_path);
      for (size_t i = 0; i < files.size(); ++i) {
        check_not_empty(c, files[i], raw[i]);
        bytes += static_cast<int64_t>(std::filesystem::file_size(files[i]));
      }
      check_windows(bytes, c.get_int("seq_len"), "the text");
      for (size_t i = 0; i < files.size(); ++i)
        check_file_ids(c, files[i], raw[i], 1, vocab,
                       "the text source's ids are its bytes (0-255): give the model "
                       "vocab_size = 256, or tokenize the text into a tokens file");
    }
    if (name == "tokens") {
      const auto [path, width] = tokens_file(c, job.resolve_path);
      check_not_empty(c, path, c.get_strings("path").front());
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      LOOM_CHECK_AS(DataError, fd >= 0, c.where("path"), ": [data] path '",
                    c.get_strings("path").front(), "': cannot open '", path, "': ",
                    std::strerror(errno));
      struct stat st {};
      ::fstat(fd, &st);
      ::close(fd);
      check_token_bytes(path, static_cast<size_t>(st.st_size), width, c.get_string("dtype"));
      check_windows(static_cast<int64_t>(st.st_size) / width, c.get_int("seq_len"),
                    "'" + path + "'");
      check_file_ids(c, path, c.get_strings("path").front(), width, vocab,
                     "the file was tokenized for another vocabulary: tokenize it with the "
                     "model's tokenizer, or give the model a vocab_size above its ids (and check "
                     "[data] dtype = \"" + c.get_string("dtype") + "\")");
    }
  }
  std::shared_ptr<const Dataset> create_dataset(const std::string& name, const ConfigSection& c,
                                                Engine& engine) override {
    if (name == "random_tokens") return std::make_shared<RandomTokens>(c, engine.seed());
    if (name == "text") return std::make_shared<TextBytes>(c, engine);
    if (name == "tokens") return std::make_shared<MappedTokens>(c, engine);
    throw InternalError("core has no data source " + name);
  }
  std::unique_ptr<UpdateRule> create_update_rule(const std::string& name,
                                                 const ConfigSection& c) override {
    LOOM_INTERNAL_ASSERT(name == "adamw", "core has no optimizer ", name);
    return make_adamw(c);
  }
};

}  // namespace

std::vector<std::unique_ptr<Plugin>> make_builtin_plugins() {
  std::vector<std::unique_ptr<Plugin>> plugins;
  plugins.push_back(std::make_unique<CorePlugin>());
  return plugins;
}

}  // namespace loom
