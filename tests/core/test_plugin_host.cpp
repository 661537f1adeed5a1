// The plugin host: discovery, every refusal (missing, not a plugin, missing symbol, API and
// build mismatch, a job's plugin folder not allowed, a file others may write), and exclusive
// slots.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>

#include "loom/error.h"
#include "loom/plugin.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

// The tiny GPT job plus the test plugin folder and extra tables.
std::unique_ptr<Trainer> with_tables(const TempDir& dir, const std::string& tables) {
  std::string job = tiny_gpt_job(dir.str());
  job += "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR "\"\n" + tables;
  return Trainer::from_text(job, dir.path());
}

// Plugin commands (Plugin::commands): two plugins adding one command, or a plugin adding one
// of loom's own, are PluginErrors naming them, for `loom --help` and for running a command.
TEST(PluginHost, CommandClashesAreErrorsNamingBoth) {
  const std::filesystem::path two = LOOM_TEST_PLUGIN_DIR "/clash_two";
  const std::filesystem::path own = LOOM_TEST_PLUGIN_DIR "/clash_own";
  EXPECT_THROW_WITH(plugin_command_usages({two}), PluginError,
                    "two plugins add the command 'greet'");
  EXPECT_THROW_WITH(run_plugin_command("greet", {}, {two}), PluginError,
                    "two plugins add the command 'greet'");
  EXPECT_THROW_WITH(plugin_command_usages({own}), PluginError,
                    "adds the command 'estimate', which is one of loom's own; rename it");
  EXPECT_FALSE(is_own_command("greet"));
  for (const char* command : {"run", "check", "estimate", "plugins", "env", "consolidate",
                              "export", "generate", "eval", "plot"})
    EXPECT_TRUE(is_own_command(command)) << command;
}

TEST(PluginHost, ListsBuiltInAndInstalledPlugins) {
  const std::string text = describe_plugins();
  EXPECT_NE(text.find("core builtin"), std::string::npos) << text;
  EXPECT_NE(text.find("gpt 0.1.0"), std::string::npos) << text;
  EXPECT_NE(text.find("bert 0.1.0"), std::string::npos) << text;
  EXPECT_NE(text.find("n_layer (integer, default 12)"), std::string::npos) << text;
  EXPECT_EQ(text.find("FAILED"), std::string::npos) << text;
}

TEST(PluginHost, ListsLoadFailuresWithoutThrowing) {
  const std::string text = describe_plugins({LOOM_TEST_PLUGIN_DIR});
  EXPECT_NE(text.find("recorder 1.0.0"), std::string::npos) << text;
  EXPECT_NE(text.find("FAILED TO LOAD"), std::string::npos) << text;
}

TEST(PluginHost, LoadsAPluginByItsTable) {
  TempDir dir;
  auto trainer = with_tables(dir, "[recorder]\nfile = \"" + dir.str() + "/events.txt\"\n");
  EXPECT_NE(trainer->describe().find("recorder"), std::string::npos);
}

// Note [Plugin order]: the order line of `loom check` (Trainer::describe).
std::string order_of(const TempDir& dir, const std::string& tables) {
  const std::string text = with_tables(dir, tables)->describe();
  const size_t at = text.find("  order      ");
  EXPECT_NE(at, std::string::npos) << text;
  return text.substr(at + 13, text.find('\n', at) - at - 13);
}

// The in-tree plugins keep the order their priority numbers gave before (moe, precision, zero
// first; LoRA after all three) whatever order the job writes them in; ties go by table name.
TEST(PluginOrder, InTreePluginsOrderThemselvesByNameWhateverTheJobsOrder) {
  TempDir dir;
  EXPECT_EQ(order_of(dir, "[preload]\n[checkpointing]\n[lora]\ntarget_modules = [\"c_fc\"]\n"
                          "[zero]\n[precision]\n[moe]\n"),
            "moe precision zero gpt core checkpointing lora preload");
  EXPECT_EQ(order_of(dir, "[moe]\n[lora]\ntarget_modules = [\"c_fc\"]\n[checkpointing]\n"),
            "moe gpt core checkpointing lora");
}

// A role (the slot a plugin fills) orders like a name: slot_a fills the precision slot.
TEST(PluginOrder, ARoleNamesWhicheverPluginFillsIt) {
  TempDir dir;
  EXPECT_EQ(order_of(dir, "[order_after_precision]\n[slot_a]\n"),
            "gpt core slot_a order_after_precision");
}

// "*" puts a plugin first (or last) among those that no name orders against it; and every
// event's handlers run in the resolved order (each orderer appends its name at setup).
TEST(PluginOrder, HandlersRunInTheResolvedOrder) {
  TempDir dir;
  EXPECT_EQ(order_of(dir, "[order_last]\n[order_a]\n[order_first]\n"),
            "order_first gpt core order_a order_last");
  unsetenv("LOOM_TEST_ORDER");
  auto trainer = with_tables(dir, "[order_last]\n[order_a]\n[order_first]\n");
  trainer->setup();
  const char* seen = std::getenv("LOOM_TEST_ORDER");
  EXPECT_EQ(std::string(seen ? seen : ""), "order_first order_a order_last ");
  unsetenv("LOOM_TEST_ORDER");
}

TEST(PluginOrder, ACycleIsAnErrorNamingEveryPluginInIt) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[order_c]\n[order_a]\n[order_b]\n"), PluginError,
                    "form a cycle", "order_a -> order_b -> order_c -> order_a",
                    "switch one of them off");
}

// A name no plugin has is a warning, not an error: the plugin may simply not be installed.
TEST(PluginOrder, AnUnknownNameIsAWarning) {
  TempDir dir;
  testing::internal::CaptureStderr();
  std::string order;
  EXPECT_NO_THROW(order = order_of(dir, "[order_typo]\n"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(order, "gpt core order_typo");
  EXPECT_NE(err.find("plugin 'order_typo' orders itself after 'no_such_plugin', which names no "
                     "plugin loom can find"), std::string::npos) << err;
}

// Note [ABI record]: refused from the file, before any of the plugin's code runs (its static
// initialiser would abort this test).
TEST(PluginHost, RefusesAFutureApiVersionBeforeItsCodeRuns) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[future_api]\n"), PluginError, "loom_future_api.so",
                    "API version 999", "API version " + std::to_string(LOOM_PLUGIN_API_VERSION),
                    "nothing of it was run");
}

TEST(PluginHost, RefusesAnotherLibTorchBuildBeforeItsCodeRuns) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[old_torch]\n"), PluginError, "loom_old_torch.so",
                    "torch=1.13.1 cxx11abi=0", "torch=2.", "rebuild the plugin",
                    "nothing of it was run");
}

// Note [SDK digest]: the same LibTorch, API version and compiler, other SDK headers.
TEST(PluginHost, RefusesAPluginBuiltAgainstOtherSdkHeadersBeforeLoadingIt) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[other_sdk]\n"), PluginError, "loom_other_sdk.so",
                    "sdk=0123456789abcdef", std::string("sdk=") + LOOM_SDK_DIGEST,
                    "rebuild the plugin", "nothing of it was run");
}

TEST(PluginHost, RefusesALibraryThatIsNoPlugin) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[not_a_plugin]\n"), PluginError, "loom_not_a_plugin.so",
                    "has no loom ABI record", "it is not a loom plugin", "LOOM_DEFINE_PLUGIN");
}

TEST(PluginHost, RefusesAFileThatIsNoLibrary) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[garbage]\n"), PluginError,
                    "cannot load plugin", "loom_garbage.so");
}

TEST(PluginHost, ReportsAMissingSymbol) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[missing_symbol]\n"), PluginError,
                    "loom_missing_symbol.so", "loom_function_that_does_not_exist");
}

TEST(PluginHost, MissingPluginIsAConfigError) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[recordr]\nfile = \"x\"\n"), ConfigError,
                    "[recordr] names no known plugin", "did you mean 'recorder'");
}

TEST(PluginHost, TwoPluginsInOneSlot) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[slot_a]\n[slot_b]\n"), ConfigError,
                    "slot 'precision' is claimed twice", "'slot_a'", "'slot_b'");
  EXPECT_NO_THROW(with_tables(dir, "[slot_a]\n"));
}

TEST(PluginHost, PluginSchemaIsValidated) {
  TempDir dir;
  EXPECT_THROW_WITH(with_tables(dir, "[recorder]\n"), ConfigError, "[recorder] needs 'file'");
  EXPECT_THROW_WITH(with_tables(dir, "[recorder]\nfile = \"x\"\nfiel = 1\n"), ConfigError,
                    "unknown key 'fiel' in [recorder]", "did you mean 'file'");
}

// Note [Job plugin paths]: for each test, job plugin folders allowed or not, whatever the
// suite's main() and the environment said; both restored afterwards.
class JobPluginPermission {
 public:
  explicit JobPluginPermission(bool allowed) {
    if (const char* env = std::getenv("LOOM_ALLOW_JOB_PLUGINS")) saved_env_ = env;
    unsetenv("LOOM_ALLOW_JOB_PLUGINS");
    allow_job_plugins(allowed);
  }
  ~JobPluginPermission() {
    if (saved_env_) setenv("LOOM_ALLOW_JOB_PLUGINS", saved_env_->c_str(), 1);
    allow_job_plugins(true);  // as test_main.cpp leaves it
  }

 private:
  std::optional<std::string> saved_env_;
};

TEST(JobPluginPaths, AreRefusedUnlessTheUserAllowsThem) {
  TempDir dir;
  JobPluginPermission denied(false);
  EXPECT_THROW_WITH(with_tables(dir, "[recorder]\nfile = \"x\"\n"), ConfigError,
                    (dir / "job.toml").string() + ":", "[plugins] path = \"" LOOM_TEST_PLUGIN_DIR "\"",
                    "--allow-job-plugins", "LOOM_ALLOW_JOB_PLUGINS=1", "LOOM_PLUGIN_PATH");
  setenv("LOOM_ALLOW_JOB_PLUGINS", "0", 1);
  EXPECT_THROW(with_tables(dir, "[recorder]\nfile = \"x\"\n"), ConfigError);
  // The two ways to allow them: the environment, and the setter the CLI's flag calls.
  setenv("LOOM_ALLOW_JOB_PLUGINS", "1", 1);
  EXPECT_NO_THROW(with_tables(dir, "[recorder]\nfile = \"x\"\n"));
  unsetenv("LOOM_ALLOW_JOB_PLUGINS");
  allow_job_plugins(true);
  EXPECT_NO_THROW(with_tables(dir, "[recorder]\nfile = \"x\"\n"));
}

// The installed folder and LOOM_PLUGIN_PATH are the user's own choice: no permission needed.
TEST(JobPluginPaths, InstalledPluginsAndLoomPluginPathNeedNoPermission) {
  TempDir dir;
  JobPluginPermission denied(false);
  EXPECT_NO_THROW(Trainer::from_text(tiny_gpt_job(dir.str()), dir.path()));
  const char* saved = std::getenv("LOOM_PLUGIN_PATH");
  const std::optional<std::string> before = saved ? std::optional<std::string>(saved) : std::nullopt;
  setenv("LOOM_PLUGIN_PATH", LOOM_TEST_PLUGIN_DIR, 1);
  EXPECT_NO_THROW(
      Trainer::from_text(tiny_gpt_job(dir.str()) + "\n[recorder]\nfile = \"x\"\n", dir.path()));
  if (before) setenv("LOOM_PLUGIN_PATH", before->c_str(), 1);
  else unsetenv("LOOM_PLUGIN_PATH");
}

// Note [Trusted plugin files]: a copy of the recorder plugin in `folder`, resolved through a job.
std::unique_ptr<Trainer> recorder_from(const TempDir& dir, const std::filesystem::path& folder,
                                       const std::vector<std::string>& overrides = {}) {
  const std::string job = tiny_gpt_job(dir.str()) + "\n[plugins]\npath = \"" + folder.string() +
                          "\"\n[recorder]\nfile = \"" + dir.str() + "/events.txt\"\n";
  return Trainer::from_text(job, dir.path(), overrides);
}

void set_mode(const std::filesystem::path& path, mode_t mode) {
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

TEST(TrustedPluginFiles, AFileOrFolderOthersMayWriteIsRefusedNamingIt) {
  TempDir dir;
  const auto above = dir / "above";
  const auto folder = above / "plugins";
  std::filesystem::create_directories(folder);
  const auto file = folder / "loom_recorder.so";
  std::filesystem::copy_file(LOOM_TEST_PLUGIN_DIR "/loom_recorder.so", file);
  set_mode(above, 0755);
  set_mode(folder, 0755);
  set_mode(file, 0664);
  EXPECT_THROW_WITH(recorder_from(dir, folder), PluginError,
                    "plugin file '" + file.string() + "' is writable by its group (mode 0664)",
                    "chmod go-w '" + file.string() + "'");
  set_mode(file, 0755);
  set_mode(folder, 0777);
  EXPECT_THROW_WITH(recorder_from(dir, folder), PluginError,
                    "folder '" + folder.string() + "' (holding plugin '" + file.string() +
                        "') is writable by group and others (mode 0777)",
                    "chmod go-w '" + folder.string() + "'");
  // A sticky folder (as /tmp) is accepted above the plugin's own folder, never as that folder.
  set_mode(folder, 01777);
  EXPECT_THROW_WITH(recorder_from(dir, folder), PluginError, "(mode 1777)");
  set_mode(folder, 0755);
  set_mode(above, 0757);
  EXPECT_THROW_WITH(recorder_from(dir, folder), PluginError,
                    "folder '" + above.string() + "' (above plugin '" + file.string() +
                        "') is writable by others (mode 0757)");
  set_mode(above, 01777);
  EXPECT_NO_THROW(recorder_from(dir, folder));
  set_mode(above, 0755);
  // Another account's file: only root can make one here.
  if (geteuid() != 0) GTEST_SKIP() << "not root: cannot give the file to another user";
  ASSERT_EQ(::chown(file.c_str(), 65534, static_cast<gid_t>(-1)), 0);
  EXPECT_THROW_WITH(recorder_from(dir, folder), PluginError,
                    "plugin file '" + file.string() + "' is owned by uid 65534", "chown");
}

// A plugin found through a symbolic link is named as `link -> target` by `loom check` and by the
// run header, which names every loaded plugin's file.
TEST(TrustedPluginFiles, CheckAndTheRunHeaderNameEachPluginsRealFile) {
  TempDir dir;
  const auto folder = dir / "links";
  std::filesystem::create_directory(folder);
  const auto target = std::filesystem::canonical(LOOM_TEST_PLUGIN_DIR "/loom_recorder.so");
  std::filesystem::create_symlink(target, folder / "loom_recorder.so");
  const std::string named = (folder / "loom_recorder.so").string() + " -> " + target.string();
  auto trainer = recorder_from(dir, folder, {"train.log_level=info"});
  const std::string check = trainer->describe();
  EXPECT_NE(check.find("recorder 1.0.0: " + named), std::string::npos) << check;
  testing::internal::CaptureStderr();
  trainer->setup();
  const std::string header = testing::internal::GetCapturedStderr();
  EXPECT_NE(header.find("plugin recorder 1.0.0 from " + named), std::string::npos) << header;
  // The model's plugin, a plain file, by the path `loom check` gives it.
  const std::string gpt = "(plugin gpt 0.1.0, ";
  const size_t at = check.find(gpt);
  ASSERT_NE(at, std::string::npos) << check;
  const std::string gpt_file = check.substr(at + gpt.size(), check.find(')', at) - at - gpt.size());
  EXPECT_TRUE(std::filesystem::is_regular_file(gpt_file)) << gpt_file;
  EXPECT_NE(header.find("plugin gpt 0.1.0 from " + gpt_file + "\n"), std::string::npos) << header;
}

}  // namespace
}  // namespace loom
