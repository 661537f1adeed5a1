// Checkpoint folders: layout, manifest, verification, rotation.
#include "checkpoint_io.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "checkpoint_format.h"
#include "fsutil.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"

namespace loom {
namespace {

constexpr const char* kFormat = format::kManifestFormat;
constexpr int kFormatVersion = format::kManifestVersion;

int64_t step_of(const std::filesystem::path& folder) {
  const std::string name = folder.filename().string();
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  for (size_t i = prefix.size(); i < name.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  return std::stoll(name.substr(prefix.size()));
}

std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints_in(const std::string& dir) {
  std::vector<std::pair<int64_t, std::filesystem::path>> found;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = step_of(entry.path());
    std::error_code manifest_error;  // a looping link is no checkpoint, not a crash here
    if (step >= 0 && entry.is_directory(manifest_error) &&
        std::filesystem::exists(std::filesystem::symlink_status(entry.path() / "manifest.json",
                                                                manifest_error)))
      found.emplace_back(step, entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

namespace {

std::string optimizer_file_name(int rank, int writers) {
  char name[64];
  std::snprintf(name, sizeof name, "optimizer-%05d-of-%05d.safetensors", rank, writers);
  return name;
}

// The StateReader over a checkpoint's optimizer files: headers up front (names, pieces, global
// shapes), a file's tensors when a read first needs them (its crc32 checked then).
class ShardedStateReader final : public StateReader {
 public:
  struct File {
    std::filesystem::path path;
    uint64_t bytes = 0;
    uint32_t crc32 = 0;
    bool verified = false;
  };
  // model: model.safetensors (verified already), whose tensors are served flattened as
  // "weight/<name>".
  ShardedStateReader(std::string folder, std::vector<File> files, int64_t step, bool layout,
                     std::optional<File> model)
      : folder_(std::move(folder)), files_(std::move(files)) {
    const size_t shard_files = files_.size();
    if (model) files_.push_back(*model);
    for (size_t f = 0; f < files_.size(); ++f) {
      auto header = safetensors::read_header(files_[f].path);
      if (f >= shard_files) {  // the model file
        for (const auto& entry : header.entries) {
          const auto numel = static_cast<int64_t>(entry.numel());
          pieces_["weight/" + entry.name].push_back({f, entry, {numel}, 0, true, entry.shape});
        }
        headers_.push_back(std::move(header));
        continue;
      }
      std::map<std::string, format::PieceLayout> map;
      if (layout) map = format::parse_shard_layout(header.metadata, step, files_[f].path.string());
      for (const auto& entry : header.entries) {
        Saved saved{f, entry, entry.shape, 0, false, {}};
        if (auto it = map.find(entry.name); it != map.end()) {
          saved.global_shape = it->second.global_shape;
          saved.offset = it->second.offset;
          saved.tensor_shape = it->second.tensor_shape;
          // A piece is rows of its global tensor: the same trailing dimensions.
          const auto& piece = entry.shape;
          const auto& whole = saved.global_shape;
          LOOM_CHECK_AS(CheckpointError,
                        piece.size() == whole.size() &&
                            (piece.empty() ||
                             std::equal(piece.begin() + 1, piece.end(), whole.begin() + 1)),
                        "optimizer shard '", files_[f].path.string(), "' is corrupt: tensor '",
                        entry.name, "' of shape ", c10::IntArrayRef(piece),
                        " is not rows of its global shape ", c10::IntArrayRef(whole));
        }
        pieces_[entry.name].push_back(std::move(saved));
      }
      headers_.push_back(std::move(header));
    }
  }

  void read(const std::string& name, const std::vector<int64_t>& global_shape, int64_t offset,
            at::Tensor& into) override {
    auto it = pieces_.find(name);
    LOOM_CHECK_AS(CheckpointError, it != pieces_.end(), where(), " has no tensor '", name,
                  "' that the optimizer needs; was it saved by another optimizer or model?",
                  name.rfind("master/", 0) == 0
                      ? " (a run with [optimizer] master_dtype = \"bf16\" saves no fp32 masters; "
                        "resume it with the same master_dtype, or with the core's step driver)"
                      : "");
    read_.insert(name);
    const int64_t rows = into.dim() == 0 ? 1 : into.size(0);
    std::vector<bool> covered(static_cast<size_t>(rows), false);
    int64_t left = rows;
    for (const Saved& saved : it->second) {
      LOOM_CHECK_AS(CheckpointError,
                    saved.global_shape == global_shape && saved.entry.dtype == into.scalar_type(),
                    "'", files_[saved.file].path.string(), "': tensor '", name, "' is ",
                    c10::IntArrayRef(saved.global_shape), " ", c10::toString(saved.entry.dtype),
                    " but the job needs ", c10::IntArrayRef(global_shape), " ",
                    c10::toString(into.scalar_type()),
                    "; the checkpoint belongs to another model shape or optimizer");
      const int64_t saved_rows = saved.flatten ? saved.global_shape[0]
                                 : saved.entry.shape.empty() ? 1 : saved.entry.shape[0];
      const int64_t a = std::max(offset, saved.offset);
      const int64_t b = std::min(offset + rows, saved.offset + saved_rows);
      if (a >= b) continue;
      bool needed = false;
      for (int64_t r = a; r < b; ++r) needed |= !covered[r - offset];
      if (!needed) continue;
      at::Tensor source = tensor_of(saved);
      if (saved.flatten) source = source.reshape(-1);
      at::NoGradGuard no_grad;
      if (into.dim() == 0) {
        into.copy_(source.reshape({}));
      } else {
        into.narrow(0, a - offset, b - a)
            .copy_(source.narrow(0, a - saved.offset, b - a).to(into.device()));
      }
      for (int64_t r = a; r < b; ++r)
        if (!covered[r - offset]) covered[r - offset] = true, --left;
      if (left == 0) break;
    }
    LOOM_CHECK_AS(CheckpointError, left == 0, where(), ": rows [", offset, ", ", offset + rows,
                  ") of '", name, "' are not all in the saved shards (", left,
                  " missing); is a shard file missing from the manifest?");
  }

  std::vector<std::string> unread() const override {
    std::vector<std::string> out;
    for (const auto& [name, saved] : pieces_)
      if (!read_.count(name) && name.rfind("weight/", 0) != 0) out.push_back(name);
    return out;
  }
  bool holds(const std::string& name) const override { return pieces_.count(name) > 0; }
  std::string where() const override {
    return "'" + folder_ + "/" +
           (files_.size() == 1 ? files_.front().path.filename().string()
                               : std::string("optimizer-*.safetensors")) +
           "'";
  }

 private:
  struct Saved {
    size_t file;
    safetensors::Entry entry;
    std::vector<int64_t> global_shape;
    int64_t offset;
    bool flatten;  // a whole model tensor served as its 1-D flattening
    std::vector<int64_t> tensor_shape;
  };
  at::Tensor tensor_of(const Saved& saved) {
    File& file = files_[saved.file];
    if (!file.verified) {
      const auto d = fsutil::digest(file.path);
      LOOM_CHECK_AS(CheckpointError, d.bytes == file.bytes && d.crc32 == file.crc32,
                    "checkpoint file '", file.path.string(), "' is corrupt: ", d.bytes,
                    " bytes with crc32 ", d.crc32, ", the manifest says ", file.bytes, " and ",
                    file.crc32, "; resume from an earlier checkpoint");
      file.verified = true;
    }
    // Piece by piece: the peak is one piece, whatever the checkpoint's size.
    return safetensors::read_tensor(file.path, headers_[saved.file], saved.entry);
  }

 public:
  // What the files hold, for `loom consolidate`: each name with its global shape, the shape of
  // the tensor it flattens (if any), its dtype, and whether it is a whole model tensor.
  struct Listing {
    std::string name;
    std::vector<int64_t> global_shape, tensor_shape;
    at::ScalarType dtype;
    bool from_model_file;
  };
  std::vector<Listing> listing() const {
    std::vector<Listing> out;
    for (const auto& [name, saved] : pieces_)
      out.push_back({name, saved.front().global_shape, saved.front().tensor_shape,
                     saved.front().entry.dtype, saved.front().flatten});
    return out;
  }

 private:
  std::string folder_;
  std::vector<File> files_;
  std::vector<safetensors::Header> headers_;
  std::map<std::string, std::vector<Saved>> pieces_;
  std::set<std::string> read_;
};

}  // namespace

namespace {

// One name every rank agrees on (ranks may run on several hosts sharing output_dir).
std::filesystem::path temp_folder(const std::string& output_dir, int64_t step) {
  return std::filesystem::path(output_dir) / (".checkpoint-" + std::to_string(step) + ".tmp");
}

std::string non_finite_state(const std::string& name, int64_t step) {
  return detail::cat("optimizer state '", name, "' holds non-finite values at step ", step,
                     ": training diverged (lower [train] learning_rate)");
}

// Whether any value's exponent bits are all ones (an infinity or a NaN), in blocks so the loop
// vectorises.
template <typename Bits>
bool any_exponent_all_ones(const at::Tensor& t, Bits mask) {
  const Bits* bits = static_cast<const Bits*>(t.const_data_ptr());
  const int64_t n = t.numel();
  for (int64_t begin = 0; begin < n; begin += 4096) {
    const int64_t end = std::min<int64_t>(n, begin + 4096);
    bool any = false;
    for (int64_t i = begin; i < end; ++i) any |= (bits[i] & mask) == mask;
    if (any) return true;
  }
  return false;
}

// Host tensors are scanned on the calling thread alone: an asynchronous save's writer thread
// (Note [Asynchronous checkpoints]) must not start a second ATen thread team beside training's.
bool has_non_finite(const at::Tensor& t) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) return false;
  if (t.is_cpu() && t.is_contiguous()) {
    switch (t.scalar_type()) {
      case at::kFloat: return any_exponent_all_ones<uint32_t>(t, 0x7f800000u);
      case at::kDouble: return any_exponent_all_ones<uint64_t>(t, 0x7ff0000000000000ull);
      case at::kHalf: return any_exponent_all_ones<uint16_t>(t, 0x7c00u);
      case at::kBFloat16: return any_exponent_all_ones<uint16_t>(t, 0x7f80u);
      default: break;
    }
  }
  return !at::isfinite(t).all().item<bool>();
}

// "" if every floating tensor to be written is finite, else what is not.
std::string non_finite_problem(const CheckpointContents& c) {
  for (const auto& [name, tensor] : c.model)
    if (has_non_finite(tensor))
      return detail::cat("the model's '", name, "' holds non-finite values at step ", c.step,
                         ": training diverged (lower [train] learning_rate)");
  for (const auto& piece : c.optimizer)  // streamed pieces are checked as they are written
    if (!piece.load && has_non_finite(piece.tensor)) return non_finite_state(piece.name, c.step);
  return "";
}

}  // namespace

// Note [Checkpoint write phases] (checkpoint_io.h).
CheckpointWriter::CheckpointWriter(std::string output_dir, const CheckpointContents& c, Comm& comm)
    : output_dir_(std::move(output_dir)), c_(c), comm_(comm) {
  namespace fs = std::filesystem;
  const fs::path temp_dir = temp_folder(output_dir_, c_.step);
  // Rank 0 clears what a crashed save left; nobody writes before that.
  std::string error;
  try {
    if (comm_.rank() == 0) {
      fs::remove_all(temp_dir);
      fs::create_directories(temp_dir);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const at::Tensor status = agree(error, 0, 0);
  for (int r = 0; r < comm_.world_size(); ++r)
    LOOM_CHECK_AS(CheckpointError, status[3 * r].item<int64_t>() == 1, "saving checkpoint-",
                  c_.step, ": rank ", r, " refused or failed",
                  error.empty() ? std::string() : ": " + error,
                  "; nothing was written, the previous checkpoints are intact");
}

CheckpointWriter::~CheckpointWriter() {
  // Whatever failed (a peer gone mid-save included), no half-written folder stays behind.
  if (!committed_ && comm_.rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(temp_folder(output_dir_, c_.step), ec);
  }
}

at::Tensor CheckpointWriter::agree(const std::string& error, int64_t bytes, int64_t crc) {
  // Every rank's (ok, bytes, crc32): a failure anywhere is known everywhere, no rank waits for
  // a file that will never come.
  const int world = comm_.world_size();
  at::Tensor mine = at::tensor({error.empty() ? int64_t{1} : int64_t{0}, bytes, crc},
                               at::TensorOptions().dtype(at::kLong)).to(comm_.device());
  at::Tensor all = at::empty({3 * world}, mine.options());
  comm_.all_gather(all, mine)->wait();
  return all.cpu();
}

void CheckpointWriter::write_files() {
  namespace fs = std::filesystem;
  const CheckpointContents& c = c_;
  const int rank = comm_.rank(), world = comm_.world_size();
  const fs::path temp_dir = temp_folder(output_dir_, c.step);
  const int writers = c.optimizer_sharded ? world : 1;
  // A diverged run (an infinite learning rate) must not leave a checkpoint a resume would
  // trust: every rank checks what it would write.
  try {
    error_ = non_finite_problem(c);
  } catch (const std::exception& e) {
    error_ = e.what();
  }
  if (!error_.empty()) return;
  if (rank < writers) {
    try {
      nlohmann::ordered_json layout = nlohmann::ordered_json::object();
      std::vector<safetensors::StreamedTensor> tensors;
      for (const auto& piece : c.optimizer) {
        layout[piece.name] = {{"shape", piece.global_shape}, {"offset", piece.offset}};
        if (!piece.tensor_shape.empty()) layout[piece.name]["tensor_shape"] = piece.tensor_shape;
        // A streamed piece (offloaded state) is read when its turn comes, and checked then: a
        // non-finite value fails this rank's write, and the agreement in commit() keeps the
        // previous checkpoints.
        std::function<at::Tensor()> produce =
            piece.load ? std::function<at::Tensor()>([&piece, step = c.step] {
              at::Tensor values = piece.load();
              if (has_non_finite(values)) throw CheckpointError(non_finite_state(piece.name, step));
              return values;
            })
                       : std::function<at::Tensor()>([&piece] { return piece.tensor; });
        tensors.push_back({piece.name, piece.tensor.scalar_type(), piece.tensor.sizes().vec(),
                           std::move(produce)});
      }
      const fs::path file = temp_dir / optimizer_file_name(rank, writers);
      safetensors::save_streamed(file, tensors,
                                 {{"format", "pt"}, {"layout", layout.dump()},
                                  {"step", std::to_string(c.step)}});
      const auto d = fsutil::digest(file);
      shard_bytes_ = static_cast<int64_t>(d.bytes);
      shard_crc_ = static_cast<int64_t>(d.crc32);
    } catch (const std::exception& e) {
      error_ = e.what();
      return;
    }
  }
  if (rank != 0) return;
  try {
    std::map<std::string, NamedTensors> files = c.plugin.files;
    for (const char* reserved : {"model", "trainer"})
      LOOM_CHECK_AS(CheckpointError, !files.count(reserved), "a plugin tried to save a file '",
                    reserved, "' that belongs to the core");
    for (const auto& [stem, tensors] : files)
      LOOM_CHECK_AS(CheckpointError, stem.rfind("optimizer", 0) != 0,
                    "a plugin tried to save a file '", stem, "' that belongs to the core");
    files["model"] = c.model;
    files["trainer"] = {{"rng.cpu", c.rng_cpu}};
    if (c.rng_device.defined()) files["trainer"].emplace_back("rng.cuda", c.rng_device);
    for (const auto& [stem, tensors] : files) {
      const fs::path file = temp_dir / (stem + ".safetensors");
      safetensors::Metadata metadata = {{"format", "pt"}};
      if (stem == "model" && !c.model_partial.empty())  // Note [Partial model files]
        metadata["loom_partial"] = c.model_partial;
      safetensors::save(file, tensors, metadata);
      const auto d = fsutil::digest(file);
      rank0_files_.push_back({stem + ".safetensors", d.bytes, d.crc32});
    }
  } catch (const std::exception& e) {
    error_ = e.what();
  }
}

std::string CheckpointWriter::commit(int64_t keep, int64_t protect_step) {
  namespace fs = std::filesystem;
  const CheckpointContents& c = c_;
  const int rank = comm_.rank(), world = comm_.world_size();
  const fs::path final_dir = fs::path(output_dir_) / ("checkpoint-" + std::to_string(c.step));
  const fs::path temp_dir = temp_folder(output_dir_, c.step);
  const int writers = c.optimizer_sharded ? world : 1;
  std::string error = error_;
  at::Tensor status = agree(error, shard_bytes_, shard_crc_);
  std::string failed;
  for (int r = 0; r < world; ++r)
    if (status[3 * r].item<int64_t>() != 1) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  LOOM_CHECK_AS(CheckpointError, failed.empty(), "saving checkpoint-", c.step, ": rank(s) ",
                failed, " could not write their files", error.empty() ? "" : ": " + error,
                "; the previous checkpoints are intact");
  if (rank == 0) {
    try {
      nlohmann::ordered_json manifest = {
          {"format", kFormat},
          {"format_version", kFormatVersion},
          {"loom_version", LOOM_VERSION},
          {"step", c.step},
          {"seed", c.seed},
          {"config_hash", c.config_hash},
          {"update_rule", c.update_rule},
          {"world_size", c.world_size},
          {"data", {{"epoch", c.data.epoch}, {"cursor", c.data.cursor}}},
          {"skipped_updates", c.skipped_updates},
          {"loss_scale", c.loss_scale},
          {"values", c.plugin.values}};
      if (!c.job_text.empty()) manifest["job"] = {{"text", c.job_text}, {"dir", c.job_dir}};
      if (!c.label_names.empty()) manifest["labels"] = c.label_names;
      nlohmann::ordered_json listing = nlohmann::ordered_json::object();
      for (const auto& file : rank0_files_)
        listing[file.name] = {{"bytes", file.bytes}, {"crc32", file.crc32}};
      nlohmann::ordered_json shards = nlohmann::ordered_json::array();
      for (int r = 0; r < writers; ++r)
        shards.push_back({{"file", optimizer_file_name(r, writers)},
                          {"bytes", status[3 * r + 1].item<int64_t>()},
                          {"crc32", static_cast<uint32_t>(status[3 * r + 2].item<int64_t>())}});
      manifest["files"] = listing;
      manifest["optimizer_shards"] = shards;
      // Note [Manifest checksum] (checkpoint_format.h): its own, of everything above.
      manifest["manifest_crc32"] =
          format::manifest_checksum(manifest.dump(), (temp_dir / "manifest.json").string());
      fsutil::write_file_atomic(temp_dir / "manifest.json", manifest.dump(2) + "\n");
      fsutil::fsync_dir(temp_dir);
      if (fs::exists(final_dir)) fs::remove_all(final_dir);
      fs::rename(temp_dir, final_dir);
      fsutil::fsync_dir(output_dir_);
      error.clear();
    } catch (const std::exception& e) {
      error = e.what();
      std::error_code ec;
      fs::remove_all(temp_dir, ec);
    }
  }
  // Nobody goes on (and reads, or saves again) before the folder is complete or known failed.
  status = agree(error, 0, 0);
  LOOM_CHECK_AS(CheckpointError, status[0].item<int64_t>() == 1, "saving checkpoint-", c.step,
                " failed on rank 0", error.empty() ? std::string() : ": " + error,
                "; the previous checkpoints are intact");
  committed_ = true;
  if (rank == 0 && keep > 0) {
    // Note [Best model]: the protected checkpoint stays and counts as one of the kept; the
    // newest always stays too.
    std::vector<std::pair<int64_t, fs::path>> others;
    for (auto& entry : checkpoints_in(output_dir_))
      if (entry.first != protect_step || protect_step == c.step) others.push_back(std::move(entry));
    const fs::path best = fs::path(output_dir_) / ("checkpoint-" + std::to_string(protect_step));
    // The newest protected is plain rotation; an older one takes one of the places.
    const bool protecting = protect_step >= 0 && protect_step != c.step && fs::exists(best);
    const size_t room = static_cast<size_t>(std::max<int64_t>(1, keep - (protecting ? 1 : 0)));
    for (size_t i = 0; i + room < others.size(); ++i) fs::remove_all(others[i].second);
  }
  return final_dir.string();
}

std::string write_checkpoint(const std::string& output_dir, const CheckpointContents& c,
                             int64_t keep, Comm& comm, int64_t protect_step) {
  CheckpointWriter writer(output_dir, c, comm);
  writer.write_files();
  return writer.commit(keep, protect_step);
}

// ---- Note [One run per output_dir] ----

namespace {

std::mutex g_claims_mutex;
std::map<std::string, std::pair<int, int>> g_claims;  // canonical dir -> (lock fd, holders)

}  // namespace

OutputDirClaim::OutputDirClaim(const std::string& output_dir) {
  namespace fs = std::filesystem;
  dir_ = fs::weakly_canonical(output_dir).string();
  std::lock_guard<std::mutex> lock(g_claims_mutex);
  auto held = g_claims.find(dir_);
  if (held != g_claims.end()) {  // this process has it already (an embedding program's trainers)
    ++held->second.second;
    return;
  }
  const std::string lock_path = dir_ + "/.loom.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  LOOM_CHECK_AS(CheckpointError, fd >= 0, "output_dir ", dir_, ": cannot create ", lock_path,
                ": ", std::strerror(errno), "; give the job a writable [train] output_dir");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char owner[128] = {0};
    const ssize_t n = ::pread(fd, owner, sizeof owner - 1, 0);
    ::close(fd);
    std::string who = n > 0 ? std::string(owner, static_cast<size_t>(n)) : std::string("?");
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw CheckpointError(detail::cat(
        "output_dir ", dir_, " is in use by another loom run (", who,
        ", holding ", lock_path, "); give this job its own [train] output_dir, or wait for "
        "that run to end (nothing was changed)"));
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string owner = detail::cat("pid ", ::getpid(), " on ", host, "\n");
  if (::ftruncate(fd, 0) == 0) {
    const ssize_t ignored = ::pwrite(fd, owner.data(), owner.size(), 0);
    (void)ignored;
  }
  g_claims[dir_] = {fd, 1};
  // Holding the lock, every temporary checkpoint folder here belongs to a run that is gone: a
  // save it never finished (killed, or out of disk).
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".checkpoint-", 0) == 0 && name.size() > 4 &&
        name.compare(name.size() - 4, 4, ".tmp") == 0 && entry.is_directory(ec)) {
      std::error_code removed;
      fs::remove_all(entry.path(), removed);
      if (!removed) removed_.push_back(name);
    }
  }
}

OutputDirClaim::~OutputDirClaim() {
  std::lock_guard<std::mutex> lock(g_claims_mutex);
  auto held = g_claims.find(dir_);
  if (held == g_claims.end() || --held->second.second > 0) return;
  ::close(held->second.first);  // releases the lock; the file stays (removing it would race)
  g_claims.erase(held);
}

namespace {

// Whether `file` exists as a name in its folder, not following a symbolic link (a loop of
// links would make std::filesystem::exists throw a message that names no checkpoint).
bool present(const std::filesystem::path& file) {
  std::error_code ec;
  return std::filesystem::exists(std::filesystem::symlink_status(file, ec));
}

// A checkpoint holds its own regular files: a FIFO would block the read forever and /dev/zero
// never end, and a symbolic link (a loop of them included) would make the checkpoint another
// file's, which can change or vanish under it.
void require_regular_file(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_symlink(std::filesystem::symlink_status(file, ec))) {
    std::error_code ignored;
    const auto target = std::filesystem::read_symlink(file, ignored);
    throw CheckpointError(detail::cat(
        "checkpoint file '", file.string(), "' is a symbolic link (to '", target.string(),
        "'); a checkpoint holds its own files, never links: copy the file itself in its place "
        "(cp --dereference), or resume from another checkpoint"));
  }
  const auto status = std::filesystem::status(file, ec);
  LOOM_CHECK_AS(CheckpointError, !ec && std::filesystem::is_regular_file(status),
                "checkpoint file '", file.string(), "' is not a regular file (",
                std::filesystem::is_directory(status) ? "a directory"
                : std::filesystem::is_fifo(status)    ? "a FIFO"
                : std::filesystem::is_character_file(status) || std::filesystem::is_block_file(status)
                    ? "a device"
                    : "not a file",
                "); a checkpoint holds regular files only: resume from another checkpoint");
}

// load = false: verify every file, load none (consolidate streams them itself).
ReadCheckpoint read_checkpoint_files(const std::string& folder, bool load) {
  namespace fs = std::filesystem;
  const fs::path manifest_path = fs::path(folder) / "manifest.json";
  std::error_code folder_error;
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(folder, folder_error), "checkpoint folder '", folder,
                "' does not exist (check the path, or [train] resume)");
  LOOM_CHECK_AS(CheckpointError, present(manifest_path), "'", manifest_path.string(),
                "' is missing: '", folder, "' is not a complete loom checkpoint");
  require_regular_file(manifest_path);
  // A manifest is a few kilobytes; a huge one is not one (and is not read into memory).
  constexpr uintmax_t kMaxManifest = 64ull << 20;
  std::error_code size_error;
  const uintmax_t manifest_bytes = fs::file_size(manifest_path, size_error);
  LOOM_CHECK_AS(CheckpointError, !size_error && manifest_bytes <= kMaxManifest, "'",
                manifest_path.string(), "' is corrupt: ",
                size_error ? size_error.message() : std::to_string(manifest_bytes) + " bytes",
                "; resume from an earlier checkpoint or delete this one");
  std::ifstream in(manifest_path, std::ios::binary);
  std::string text(manifest_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  LOOM_CHECK_AS(CheckpointError, in.good() || text.empty(), "'", manifest_path.string(),
                "' cannot be read: ", std::strerror(errno));
  const format::Manifest manifest = format::parse_manifest(text, manifest_path.string());
  ReadCheckpoint out;
  CheckpointContents& c = out.contents;
  const int version = manifest.version;
  c.step = manifest.step;
  c.seed = manifest.seed;
  c.config_hash = manifest.config_hash;
  c.update_rule = manifest.update_rule;
  c.world_size = manifest.world_size;
  c.data.epoch = manifest.epoch;
  c.data.cursor = manifest.cursor;
  c.skipped_updates = manifest.skipped_updates;
  c.loss_scale = manifest.loss_scale;
  c.plugin.values = manifest.values;
  c.job_text = manifest.job_text;
  c.job_dir = manifest.job_dir;
  c.label_names = manifest.label_names;
  std::vector<ShardedStateReader::File> shards;
  for (const auto& shard : manifest.optimizer_shards)
    shards.push_back({fs::path(folder) / shard.name, shard.bytes, shard.crc32});
  std::optional<ShardedStateReader::File> model_file;
  for (const auto& [name, bytes, crc] : manifest.files) {
    const fs::path file = fs::path(folder) / name;
    LOOM_CHECK_AS(CheckpointError, present(file), "checkpoint file '", file.string(),
                  "' is missing; the checkpoint is incomplete");
    require_regular_file(file);
    const auto d = fsutil::digest(file);
    LOOM_CHECK_AS(CheckpointError, d.bytes == bytes, "checkpoint file '", file.string(),
                  "' is truncated or padded: ", d.bytes, " bytes, the manifest says ", bytes,
                  "; resume from an earlier checkpoint");
    LOOM_CHECK_AS(CheckpointError, d.crc32 == crc, "checkpoint file '", file.string(),
                  "' is corrupt: crc32 ", d.crc32, ", the manifest says ", crc,
                  "; resume from an earlier checkpoint");
    const std::string stem = name.substr(0, name.size() - std::string(".safetensors").size());
    if (stem == "optimizer" && version == 1) {
      // Format 1: the whole optimizer state in one file, whole tensors.
      shards.push_back({file, bytes, crc, true});
      continue;
    }
    if (stem == "model") model_file = ShardedStateReader::File{file, bytes, crc, true};
    if (!load) continue;
    auto contents = safetensors::load(file);
    if (stem == "model") {
      c.model = std::move(contents.tensors);
    }
    else if (stem == "trainer") {
      for (auto& [key, tensor] : contents.tensors)
        if (key == "rng.cpu") c.rng_cpu = tensor;
        else if (key == "rng.cuda") c.rng_device = tensor;
    } else c.plugin.files[stem] = std::move(contents.tensors);
  }
  // Shards: present and of the right size now (a missing or truncated one fails before any
  // state changes); their crc32 when a rank first reads from them.
  for (const auto& shard : shards) {
    LOOM_CHECK_AS(CheckpointError, present(shard.path), "optimizer shard '",
                  shard.path.string(), "' is missing; the checkpoint is incomplete");
    require_regular_file(shard.path);
    const auto size = fs::file_size(shard.path);
    LOOM_CHECK_AS(CheckpointError, size == shard.bytes, "optimizer shard '", shard.path.string(),
                  "' is truncated or padded: ", size, " bytes, the manifest says ", shard.bytes,
                  "; resume from an earlier checkpoint");
  }
  LOOM_CHECK_AS(CheckpointError, !load || c.rng_cpu.defined(), "checkpoint '", folder,
                "' lacks trainer.safetensors (rng.cpu)");
  LOOM_CHECK_AS(CheckpointError, model_file.has_value(), "checkpoint '", folder,
                "' lacks model.safetensors");
  out.state = std::make_unique<ShardedStateReader>(folder, std::move(shards), c.step, version >= 2,
                                                   model_file);
  return out;
}

}  // namespace

ReadCheckpoint read_checkpoint(const std::string& folder) {
  return read_checkpoint_files(folder, /*load=*/true);
}

CheckpointContents read_checkpoint_info(const std::string& folder) {
  return std::move(read_checkpoint_files(folder, /*load=*/false).contents);
}

void consolidate_checkpoint_folder(const std::string& folder, const std::string& out_file) {
  namespace fs = std::filesystem;
  ReadCheckpoint read = read_checkpoint_files(folder, /*load=*/false);
  auto& reader = dynamic_cast<ShardedStateReader&>(*read.state);
  // The model's tensors: every whole one of model.safetensors, and every weight kept as shards
  // (ZeRO stage 3); a trainable weight with fp32 masters takes the masters' values (the truth
  // of a mixed-precision run). Floating tensors come out fp32, others as they are.
  struct Out {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    bool master;
  };
  std::map<std::string, Out> outs;
  std::set<std::string> masters;
  const auto listing = reader.listing();
  for (const auto& item : listing)
    if (item.name.rfind("master/", 0) == 0) masters.insert(item.name.substr(7));
  for (const auto& item : listing) {
    if (item.name.rfind("weight/", 0) != 0) continue;
    const std::string name = item.name.substr(7);
    const auto shape = item.tensor_shape.empty() ? item.global_shape : item.tensor_shape;
    const bool floating = at::isFloatingType(item.dtype);
    outs[name] = {name, shape, floating ? at::kFloat : item.dtype, masters.count(name) > 0};
  }
  LOOM_CHECK_AS(CheckpointError, !outs.empty(), "checkpoint '", folder, "' holds no weights");
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"},
                            {"source", fs::absolute(folder).lexically_normal().string()},
                            {"step", std::to_string(read.contents.step)}};
  uint64_t offset = 0;
  for (const auto& [name, out] : outs) {
    int64_t numel = 1;
    for (int64_t d : out.shape) numel *= d;
    const uint64_t bytes = static_cast<uint64_t>(numel) * c10::elementSize(out.dtype);
    header[name] = {{"dtype", safetensors::dtype_name(out.dtype)},
                    {"shape", out.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  fsutil::AtomicFile file(out_file);
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  file.write(le, 8);
  file.write(text.data(), text.size());
  // One tensor at a time: the peak is the largest tensor (plus the piece being copied).
  for (const auto& [name, out] : outs) {
    int64_t numel = 1;
    for (int64_t d : out.shape) numel *= d;
    at::Tensor flat;
    if (out.master) {
      flat = at::empty({numel}, at::kFloat);
      reader.read("master/" + name, {numel}, 0, flat);
    } else {
      const auto& item = *std::find_if(listing.begin(), listing.end(), [&](const auto& l) {
        return l.name == "weight/" + name;
      });
      flat = at::empty({numel}, item.dtype);
      reader.read("weight/" + name, {numel}, 0, flat);
      flat = flat.to(out.dtype);
    }
    file.write(flat.data_ptr(), static_cast<size_t>(flat.numel() * flat.element_size()));
  }
  file.commit();
}

void consolidate_checkpoint(const std::filesystem::path& checkpoint,
                            const std::filesystem::path& out_file) {
  consolidate_checkpoint_folder(checkpoint.string(), out_file.string());
}

std::string latest_checkpoint(const std::string& output_dir) {
  auto all = checkpoints_in(output_dir);
  return all.empty() ? "" : all.back().second.string();
}

}  // namespace loom
