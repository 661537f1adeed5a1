// The collective trace of a Comm group and its hang report (Note [Hang reports]).
//
// Note [Hang reports]: a rank that stops (SIGSTOP, a debugger, a swap storm), dies, or takes
// another path through the code (a plugin skipping a collective on one rank) leaves its peers
// waiting in a collective until [distributed] timeout_seconds; the backend's own error then
// says only "Operation timed out". So every group keeps, per rank:
// - a ring of its last kRing collectives (sequence number, op, elements, dtype, entered when,
//   finished or not), written by begin/finish under one uncontended mutex: about 0.3 us per
//   collective, against a step's milliseconds (docs/RELIABILITY.md "Hangs");
// - a poster thread that writes one line to the group's TraceBoard (the rendezvous store for
//   gloo/nccl, files for mpi) whenever the trace moved, at most every kPostEvery, and at least
//   every kBeatEvery as a heartbeat: "BEAT SEQ OP COUNT DTYPE FINISHED". The collective itself
//   never waits on the board — the store round trip (tens of microseconds) stays off the
//   training thread, and a stalled store cannot stall training.
// When a collective fails or times out, diagnose() logs this rank's ring, reads every peer's
// line twice, kReadGap apart, and names: the ranks behind (their last collective), the ranks in
// another collective at the same number or ahead (diverged), and the ranks whose heartbeat did
// not move (stopped, or dead). A peer's line may lag its truth by kPostEvery; after a timeout
// of seconds it is the peer's state at the hang. What it cannot tell: which of two ranks is
// "right" when they diverged (it names both), and where a silent rank is inside its code.
#include "comm_trace.h"

#include <algorithm>
#include <sstream>

#include "loom/error.h"
#include "loom/log.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPostEvery = std::chrono::milliseconds(10);
constexpr auto kBeatEvery = std::chrono::milliseconds(1000);
constexpr auto kReadGap = std::chrono::milliseconds(2500);  // > 2 heartbeats

// The ops a fingerprint can name, by code (a fingerprint carries the code, not the text).
constexpr const char* kOps[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "all_to_all", "all_to_all_rows", "barrier", "split"};
constexpr const char* kReduceOps[] = {"sum", "avg", "max", "min"};

int64_t op_code(const char* op) {
  for (size_t i = 0; i < std::size(kOps); ++i)
    if (std::string(kOps[i]) == op) return static_cast<int64_t>(i);
  return -1;
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::Undefined: return "-";
    default: return c10::toString(dtype);
  }
}

// "all_reduce #57 (4096 float32)", from parts (a ring record, a peer's line, a fingerprint).
std::string describe_call(const std::string& op, int64_t seq, int64_t count,
                          const std::string& dtype) {
  if (op == "barrier" || op == "split") return detail::cat(op, " #", seq);
  if (count < 0) return detail::cat(op, " #", seq, " (", dtype, ")");
  return detail::cat(op, " #", seq, " (", count, " ", dtype, ")");
}

// A peer's posted line, parsed; nullopt when malformed.
struct PeerLine {
  int64_t beat = 0, seq = 0, count = 0;
  std::string op, dtype;
  bool finished = true;
};
std::optional<PeerLine> parse_line(const std::string& text) {
  std::istringstream in(text);
  PeerLine line;
  int finished = 1;
  if (!(in >> line.beat >> line.seq >> line.op >> line.count >> line.dtype >> finished))
    return std::nullopt;
  line.finished = finished != 0;
  return line;
}

std::string seconds(std::chrono::steady_clock::duration d) {
  const double s = std::chrono::duration<double>(d).count();
  std::ostringstream out;
  out.precision(s < 10 ? 2 : 3);
  out << s << " s";
  return out.str();
}

}  // namespace

TraceBoard::~TraceBoard() = default;

CollectiveTrace::CollectiveTrace(std::string group, int rank, int world,
                                 std::chrono::milliseconds timeout,
                                 std::unique_ptr<TraceBoard> board)
    : group_(std::move(group)), rank_(rank), world_(world), timeout_(timeout),
      board_(std::move(board)) {
  if (board_ || world_ > 1) poster_ = std::thread([this] { post_loop(); });
}

CollectiveTrace::~CollectiveTrace() {
  {
    std::lock_guard<std::mutex> lock(post_mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (poster_.joinable()) poster_.join();
}

int64_t CollectiveTrace::begin(const CollectiveCall& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  Record& record = ring_[static_cast<size_t>(last_seq_ % kRing)];
  record.seq = ++last_seq_;
  record.call = call;
  record.entered = Clock::now();
  record.finished = false;
  ++changes_;
  return record.seq;
}

void CollectiveTrace::finish(int64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  Record& record = ring_[static_cast<size_t>((seq - 1) % kRing)];
  if (record.seq == seq && !record.finished) {
    record.finished = true;
    ++changes_;
  }
}

const CollectiveTrace::Record* CollectiveTrace::find(int64_t seq) const {
  if (seq < 1) return nullptr;
  const Record& record = ring_[static_cast<size_t>((seq - 1) % kRing)];
  return record.seq == seq ? &record : nullptr;
}

std::string CollectiveTrace::describe(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Record* record = find(seq);
  if (!record) return detail::cat("collective #", seq);
  return describe_call(record->call.op, seq, record->call.count, dtype_name(record->call.dtype));
}

std::string CollectiveTrace::line_of(const Record& record) const {
  return detail::cat(record.seq, " ", record.call.op, " ", record.call.count, " ",
                     dtype_name(record.call.dtype), " ", record.finished ? 1 : 0);
}

void CollectiveTrace::post_loop() {
  int64_t posted_changes = -1, beat = 0;
  auto last_post = Clock::now() - kBeatEvery;
  std::unique_lock<std::mutex> wait_lock(post_mutex_);
  while (!stop_) {
    wake_.wait_for(wait_lock, kPostEvery, [this] { return stop_; });
    if (stop_) continue;
    std::string state;
    int64_t changes = 0, blocked = 0;
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      changes = changes_;
      const Record* last = find(last_seq_);
      state = last ? line_of(*last) : "0 - 0 - 1";
      if (last && last->call.blocking && !last->finished && last->seq != watchdog_reported_ &&
          now - last->entered > timeout_)
        blocked = last->seq;
    }
    if (blocked) {  // the watchdog: a call no wait() will time out
      watchdog_reported_ = blocked;
      wait_lock.unlock();
      log::error("rank ", rank_, ": ", describe(blocked), " of group ", group_,
                 " has not returned after [distributed] timeout_seconds = ",
                 timeout_.count() / 1000.0, " s; it blocks and cannot be timed out here",
                 diagnose(blocked), ". End the job (mpirun ends every rank when one exits)");
      wait_lock.lock();
      continue;
    }
    if (!board_ || board_failed_) continue;
    if (changes == posted_changes && now - last_post < kBeatEvery) continue;
    wait_lock.unlock();  // a stalled store must not hold the destructor's stop
    try {
      std::lock_guard<std::mutex> board_lock(board_mutex_);
      board_->post(rank_, detail::cat(++beat, " ", state));
      posted_changes = changes;
      last_post = now;
    } catch (const std::exception& error) {
      board_failed_ = true;  // the store's host is gone: the report will say so
      log::debug("collective trace (", group_, "): posting stopped: ", error.what());
    }
    wait_lock.lock();
  }
}

std::string CollectiveTrace::diagnose(int64_t seq) {
  // Once per group: the other collectives in flight at a hang (ddp's buckets) fail with it,
  // and their reports would only repeat the first (and each take kReadGap).
  std::lock_guard<std::mutex> once(diagnose_mutex_);
  if (!diagnosis_) diagnosis_ = first_diagnosis(seq);
  return *diagnosis_;
}

std::string CollectiveTrace::first_diagnosis(int64_t seq) {
  try {
    // This rank's own ring, oldest first: what it did just before the hang.
    std::string ring;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto now = Clock::now();
      for (int64_t s = std::max<int64_t>(1, last_seq_ - static_cast<int64_t>(kRing) + 1);
           s <= last_seq_; ++s) {
        const Record* r = find(s);
        if (!r) continue;
        ring += detail::cat("\n  ", describe_call(r->call.op, s, r->call.count,
                                                  dtype_name(r->call.dtype)),
                            r->finished ? " done" : " NOT DONE", ", entered ",
                            seconds(now - r->entered), " ago");
      }
    }
    log::error("rank ", rank_, ": the last collectives of group ", group_, " here:", ring);
    if (world_ < 2) return "";
    if (!board_)
      return " (no rendezvous store to ask the other ranks where they are: see each rank's "
             "log for its last collectives)";

    const std::string mine = describe(seq);
    std::string my_op;
    // The last collective before `seq` that completed here: every rank of the group took
    // part in it, so a peer whose posted line is older (it lags by up to kPostEvery) got at
    // least that far.
    int64_t done_here = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const Record* record = find(seq);
      my_op = record ? record->call.op : "";
      for (int64_t s = seq - 1; s >= 1; --s) {
        const Record* r = find(s);
        if (!r) break;
        if (r->finished) {
          done_here = s;
          break;
        }
      }
    }
    // Two snapshots of every peer's line, kReadGap apart: a heartbeat that did not move
    // between them is a rank that is not running (stopped, or dead).
    auto snapshot = [this]() {
      std::lock_guard<std::mutex> board_lock(board_mutex_);
      std::vector<std::optional<PeerLine>> lines(static_cast<size_t>(world_));
      for (int r = 0; r < world_; ++r) {
        if (r == rank_) continue;
        const std::optional<std::string> text = board_->read(r);
        if (text) lines[static_cast<size_t>(r)] = parse_line(*text);
      }
      return lines;
    };
    std::vector<std::optional<PeerLine>> first, second;
    try {
      first = snapshot();
      std::this_thread::sleep_for(kReadGap);
      second = snapshot();
    } catch (const std::exception& error) {
      board_failed_ = true;
      return detail::cat("; the rendezvous store (", board_->where(), ") did not answer (",
                         error.what(), "): its host — rank 0 — is likely stopped or dead");
    }

    int64_t last_here = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last_here = last_seq_;
    }
    std::vector<std::string> findings;
    int listed = 0, more = 0;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      auto now = second[static_cast<size_t>(r)];
      const auto& before = first[static_cast<size_t>(r)];
      std::string finding;
      if (!now || now->seq == 0) {
        finding = detail::cat("rank ", r, " has not started any collective of group ", group_);
        if (now && before && before->beat == now->beat)
          finding += detail::cat("; it has been silent for ", seconds(kReadGap),
                                 " (stopped, or dead)");
        else if (!now)
          finding += " (it posted nothing: it never got this far, or cannot reach the store)";
      } else {
        const bool silent = before && before->beat == now->beat;
        std::string where = describe_call(now->op, now->seq, now->count, now->dtype);
        if (now->seq < done_here) {
          where = describe(done_here);
          now->seq = done_here;
          now->finished = true;
        }
        // The peer's collective at its number, as this rank called it: another call at the
        // same number is the one sure sign of ranks on different paths. (With asynchronous
        // collectives — ddp's buckets — a rank may be a few numbers ahead of the one waited
        // on, legitimately.)
        const std::string here = now->seq <= last_here ? describe(now->seq) : "";
        const bool diverged = !here.empty() && here.rfind("collective #", 0) != 0 && here != where;
        const std::string unfinished = now->finished ? "" : ", not finished";
        if (diverged) {
          finding = detail::cat("rank ", r, " called ", where, " where this rank called ", here,
                                ": the ranks took different paths (a collective skipped, added "
                                "or reordered on one of them)");
        } else if (now->seq < seq) {
          finding = detail::cat("rank ", r, " did not reach ", mine, ": its last collective was ",
                                where, unfinished);
          if (!silent) finding += "; it is running, so it is slow or on another path";
        } else if (silent) {
          finding = detail::cat("rank ", r, " reached ", mine, " (its last collective was ",
                                where, unfinished, ")");
        } else if (now->seq > last_here) {
          finding = detail::cat("rank ", r, " is ahead, at ", where, ": the ranks took different "
                                "paths (a collective skipped on this one)");
        }
        if (silent)
          finding += detail::cat("; it has been silent for ", seconds(kReadGap),
                                 " (stopped, or dead)");
      }
      if (finding.empty()) continue;
      if (listed < 8) {
        findings.push_back(finding);
        ++listed;
      } else {
        ++more;
      }
    }
    if (findings.empty())
      return detail::cat("; every rank reached ", mine, " and is running: the transfer itself "
                         "stalled (network, or a collective too slow for the timeout)");
    std::string text;
    for (const auto& f : findings) text += "; " + f;
    if (more) text += detail::cat("; and ", more, " more rank(s)");
    return text;
  } catch (const std::exception& error) {
    return detail::cat(" (the hang report failed: ", error.what(), ")");
  }
}

std::array<int64_t, CollectiveTrace::kFingerprint> CollectiveTrace::fingerprint(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Record* record = find(seq);
  LOOM_INTERNAL_ASSERT(record, "fingerprint of a collective not in the ring");
  // The group's label hashed, so collectives of two groups never compare equal by accident.
  int64_t group_hash = 1469598103934665603LL;
  for (const char c : group_) group_hash = (group_hash ^ c) * 1099511628211LL;
  return {seq, op_code(record->call.op), record->call.detail, record->call.count,
          static_cast<int64_t>(record->call.dtype), group_hash};
}

void CollectiveTrace::check_fingerprints(int64_t seq, const int64_t* all) const {
  const int64_t* mine = all + static_cast<ptrdiff_t>(rank_) * kFingerprint;
  auto text = [](const int64_t* f) {
    const std::string op = f[1] >= 0 && f[1] < static_cast<int64_t>(std::size(kOps))
                               ? kOps[f[1]] : "an unknown op";
    std::string call = describe_call(op, f[0], f[3],
                                     dtype_name(static_cast<c10::ScalarType>(f[4])));
    if ((op == "all_reduce" || op == "reduce_scatter") && f[2] >= 0 && f[2] < 4)
      call += detail::cat(" ", kReduceOps[f[2]]);
    if (op == "broadcast") call += detail::cat(" from rank ", f[2]);
    return call;
  };
  for (int r = 0; r < world_; ++r) {
    const int64_t* theirs = all + static_cast<ptrdiff_t>(r) * kFingerprint;
    if (std::equal(mine, mine + kFingerprint, theirs)) continue;
    throw Error(detail::cat(
        "rank ", rank_, ": [distributed] check_collectives: collective #", seq, " of group ",
        group_, " differs between ranks: rank ", rank_, " calls ", text(mine), ", rank ", r,
        " calls ", text(theirs), theirs[5] != mine[5] ? " in another group" : "",
        " — the ranks took different paths through the code (a collective skipped, added or "
        "reordered on one of them)"));
  }
}

}  // namespace loom
