// The plugin host: discovery, every refusal (missing, not a plugin, missing symbol, API and
// build mismatch), and exclusive slots.
#include <filesystem>

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
                              "export", "generate"})
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
  auto trainer = with_tables(dir, "[recorder]\nfile = \"events.txt\"\n");
  EXPECT_NE(trainer->describe().find("recorder"), std::string::npos);
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

}  // namespace
}  // namespace loom
