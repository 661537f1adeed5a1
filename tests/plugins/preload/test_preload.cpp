// The preload plugin: the batch stream is the core's for 0, 1 and 4 workers, a failing sample
// reaches the training loop with its index, workers stop mid-epoch (and on Ctrl-C) without
// leaking threads, and a resume mid-epoch equals an uninterrupted run bitwise.
#include <ATen/ATen.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "loom/data.h"
#include "loom/engine.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;
using Clock = std::chrono::steady_clock;

int64_t live_threads() {
  int64_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++n;
  }
  return n;
}

// A first run starts the intra-op thread pool, so later thread counts see only the workers.
void start_thread_pools() {
  TempDir dir;
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                     {"train.max_steps=1", "train.save_final=false"})
      ->run();
}

std::string with_preload(const std::string& job, const std::string& preload) {
  return job + "\n[preload]\n" + preload + "\n";
}

struct Seen {
  std::vector<at::Tensor> inputs;
  std::vector<std::vector<int64_t>> indices;
};

// 22 samples in batches of 4 without drop_last: epochs of 6 batches, the last one of 2; 14
// steps run into the third epoch, each shuffled by its own (seed, epoch).
Seen batches_seen(const std::string& preload) {
  TempDir dir;
  std::string job = tiny_gpt_job(dir.str());
  if (!preload.empty()) job = with_preload(job, preload);
  auto trainer = Trainer::from_text(
      job, dir.path(),
      {"train.max_steps=14", "data.num_samples=22", "data.drop_last=false",
       "data.sample_cost_us=300", "train.save_final=false"});
  Seen seen;
  trainer->engine().on(Event::batch, [&](Engine& e) {
    seen.inputs.push_back(e.batch().input_ids.clone());
    seen.indices.push_back(e.batch().sample_indices);
  });
  trainer->run();
  return seen;
}

TEST(Preload, SameBatchesInTheSameOrderForAnyWorkerCount) {
  const Seen core = batches_seen("");  // the core's synchronous source: the reference
  ASSERT_EQ(core.indices.size(), 14u);
  EXPECT_EQ(core.indices[5].size(), 2u);  // the epoch's short last batch
  EXPECT_NE(core.indices[0], core.indices[6]);  // epochs are shuffled differently
  for (const char* preload :
       {"num_workers = 0", "num_workers = 1", "num_workers = 4",
        "num_workers = 4\npersistent_workers = true\nprefetch_factor = 3"}) {
    const Seen got = batches_seen(preload);
    ASSERT_EQ(got.indices, core.indices) << preload;
    for (size_t i = 0; i < core.inputs.size(); ++i)
      EXPECT_TRUE(at::equal(got.inputs[i], core.inputs[i])) << preload << " batch " << i;
  }
}

TEST(Preload, AFailingSampleSurfacesInTheTrainingLoopWithItsIndex) {
  start_thread_pools();
  const int64_t threads_before = live_threads();
  for (const char* workers : {"num_workers = 3", "num_workers = 0"}) {
    TempDir dir;
    std::string job = with_preload(tiny_gpt_job(dir.str()), workers);
    job.replace(job.find("source = \"random_tokens\""), 24, "source = \"faulty_tokens\"");
    job = job.substr(0, job.find("task = ")) + "fail_index = 5\nshuffle = false\n" +
          job.substr(job.find("\n[preload]")) + "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR
          "\"\n";
    // Sample 5 is in the second batch: the first step trains, the second fails.
    auto trainer = Trainer::from_text(job, dir.path(), {"train.max_steps=3"});
    int64_t steps = 0;
    trainer->engine().on(Event::step_end, [&](Engine&) { ++steps; });
    EXPECT_THROW_WITH(trainer->run(), DataError, "sample 5 of faulty_tokens failed",
                      "bad record at 5 (test)");
    EXPECT_EQ(steps, 1) << workers;
  }
  EXPECT_EQ(live_threads(), threads_before);
}

TEST(Preload, StopsMidEpochPromptlyWithoutLeakingThreads) {
  TempDir dir;
  start_thread_pools();
  const int64_t threads_before = live_threads();
  {
    // 20 ms per sample, 4 workers x 2 batches of 4 samples in flight: 160 ms of queued work.
    auto trainer = Trainer::from_text(
        with_preload(tiny_gpt_job(dir.str()), "num_workers = 4"), dir.path(),
        {"train.max_steps=100", "data.sample_cost_us=20000", "train.save_final=false"});
    ASSERT_TRUE(trainer->step());
    EXPECT_EQ(live_threads(), threads_before + 4);
    EXPECT_EQ(trainer->engine().data().position(), (DataPosition{0, 4}));
    const auto start = Clock::now();
    trainer.reset();  // mid-epoch, with batches half-prepared
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    // A worker finishes at most the sample it is in (20 ms); joining must not wait for the queue.
    EXPECT_LT(seconds, 0.1);
  }
  EXPECT_EQ(live_threads(), threads_before);
}

TEST(Preload, ResumeMidEpochEqualsAnUninterruptedRun) {
  TempDir straight, split;
  const std::vector<std::string> set = {"train.max_steps=8", "model.dropout=0.1",
                                        "data.num_samples=24", "data.sample_cost_us=200"};
  const std::string preload = "num_workers = 3\npersistent_workers = true";
  Trainer::from_text(with_preload(tiny_gpt_job(straight.str()), preload), straight.path(), set)
      ->run();
  {
    auto first =
        Trainer::from_text(with_preload(tiny_gpt_job(split.str()), preload), split.path(), set);
    first->setup();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(first->step());
    // The workers have prepared batches beyond the third; the checkpoint names the fourth.
    EXPECT_EQ(first->engine().data().position(), (DataPosition{0, 12}));
    first->save_checkpoint();
  }
  auto resume_set = set;
  resume_set.push_back("train.resume=latest");
  auto second =
      Trainer::from_text(with_preload(tiny_gpt_job(split.str()), preload), split.path(), resume_set);
  EXPECT_EQ(second->run().steps, 8);
  for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors"}) {
    auto want = safetensors::load(straight / "checkpoint-8" / file).tensors;
    auto got = safetensors::load(split / "checkpoint-8" / file).tensors;
    ASSERT_EQ(want.size(), got.size()) << file;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << file << " " << want[i].first;
  }
}

TEST(Preload, BadSettingsAreClearErrors) {
  TempDir dir;
  auto setup_with = [&](const std::string& preload) {
    Trainer::from_text(with_preload(tiny_gpt_job(dir.str()), preload), dir.path(), {})->setup();
  };
  EXPECT_THROW_WITH(setup_with("num_workers = -1"), ConfigError, "job.toml:",
                    "[preload] num_workers must be >= 0", "got -1");
  EXPECT_THROW_WITH(setup_with("prefetch_factor = 0"), ConfigError, "job.toml:",
                    "[preload] prefetch_factor must be >= 1", "got 0");
}

TEST(Preload, CtrlCEndsARunPromptly) {
  TempDir dir;
  const auto job = dir / "job.toml";
  {
    std::ofstream out(job);
    out << with_preload(tiny_gpt_job(dir.str()), "num_workers = 4") << "\n";
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::execl(LOOM_TEST_CLI, LOOM_TEST_CLI, "run", job.c_str(), "--set", "train.max_steps=100000",
            "--set", "data.sample_cost_us=5000", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Wait until it trains (a metrics line), so the workers are busy when the signal comes.
  const auto start = Clock::now();
  while (test::read_text(dir / "metrics.jsonl").empty() && Clock::now() - start < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_FALSE(test::read_text(dir / "metrics.jsonl").empty()) << "the run never trained";
  ::kill(child, SIGINT);
  int status = 0;
  const auto sent = Clock::now();
  pid_t done = 0;
  while ((done = ::waitpid(child, &status, WNOHANG)) == 0 &&
         Clock::now() - sent < std::chrono::seconds(5))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the run did not end within 5 s of SIGINT";
  }
  // The signal reached the main thread (workers block it) and ended the process.
  EXPECT_TRUE(WIFSIGNALED(status) ? WTERMSIG(status) == SIGINT : WEXITSTATUS(status) != 0);
}

}  // namespace
}  // namespace loom
