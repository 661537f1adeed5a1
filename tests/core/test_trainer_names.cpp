// Note [Trainer names]: a job written with TrainingArguments' spellings resolves to the very job
// written in loom's own keys (the same config hash, so the same run, checkpoints and resume),
// with one line per rewrite; the same setting spelled both ways, a wrong type and a name loom
// has no equivalent for are errors naming the keys.
#include <gtest/gtest.h>

#include "loom/trainer.h"
#include "job_text.h"

namespace loom {
namespace {

using test::TempDir;

using test::config_hash_of;

std::string job(const std::string& out, const std::string& train_extra, const std::string& tables) {
  return test::tiny_gpt_job_with(out, train_extra, tables);
}

TEST(TrainerNames, TheTrainersSpellingsResolveToLoomsOwnJob) {
  TempDir a, b;
  const std::string hf_keys =
      "bf16 = true\ngradient_checkpointing = true\noptim = \"adamw_torch_fused\"\n"
      "adam_beta1 = 0.8\nadam_beta2 = 0.99\nadam_epsilon = 1e-6\nweight_decay = 0.01\n"
      "dataloader_num_workers = 2\nsave_strategy = \"no\"\nlogging_strategy = \"steps\"\n";
  const std::string loom_tables =
      "[precision]\nmode = \"bf16\"\n[checkpointing]\n[optimizer]\nname = \"adamw\"\nbeta1 = 0.8\n"
      "beta2 = 0.99\neps = 1e-6\nweight_decay = 0.01\n[preload]\nnum_workers = 2\n";
  auto hf = Trainer::from_text(job(a.str(), hf_keys, ""), a.path());
  auto own = Trainer::from_text(job(a.str(), "save_steps = 0\nsave_final = false\n", loom_tables),
                                a.path());
  const std::string described = hf->describe();
  EXPECT_EQ(config_hash_of(described), config_hash_of(own->describe())) << described;
  for (const char* line : {"[train] bf16 = true -> [precision] mode = \"bf16\"",
                           "[train] gradient_checkpointing = true -> a [checkpointing] table",
                           "[train] optim = \"adamw_torch_fused\" -> [optimizer] name = \"adamw\"",
                           "[train] adam_epsilon = 1e-06 -> [optimizer] eps = 1e-06",
                           "[train] save_strategy = \"no\" -> [train] save_final = false"})
    EXPECT_NE(described.find(line), std::string::npos) << "no line '" << line << "':\n" << described;
  // And it runs as loom's own job does, to the bit.
  auto own_run = Trainer::from_text(job(b.str(), "save_steps = 0\nsave_final = false\n", loom_tables),
                                    b.path());
  EXPECT_EQ(hf->run().final_loss, own_run->run().final_loss);
}

TEST(TrainerNames, FlagsThatAreFalseAndTf32BesideBf16ChangeNothingElse) {
  TempDir dir;
  auto plain = Trainer::from_text(job(dir.str(), "", ""), dir.path());
  auto off = Trainer::from_text(job(dir.str(), "bf16 = false\ngradient_checkpointing = false\n", ""),
                                dir.path());
  EXPECT_EQ(config_hash_of(off->describe()), config_hash_of(plain->describe()));
  auto both = Trainer::from_text(job(dir.str(), "bf16 = true\ntf32 = true\n", ""), dir.path());
  auto bf16 = Trainer::from_text(job(dir.str(), "", "[precision]\nmode = \"bf16\"\n"), dir.path());
  EXPECT_EQ(config_hash_of(both->describe()), config_hash_of(bf16->describe()));
  EXPECT_NE(both->describe().find("tf32 = true beside bf16"), std::string::npos);
}

TEST(TrainerNames, BadSpellingsAreClearErrors) {
  TempDir dir;
  auto refuse = [&](const std::string& extra, const std::string& tables,
                    const std::vector<std::string>& parts) {
    try {
      Trainer::from_text(job(dir.str(), extra, tables), dir.path());
      ADD_FAILURE() << "accepted: " << extra << tables;
    } catch (const ConfigError& error) {
      const std::string message = error.what();
      for (const auto& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << "lacks \"" << part << "\": " << message;
    }
  };
  refuse("bf16 = true\n", "[precision]\nmode = \"fp16\"\n",
         {"[train] bf16 and", "[precision] mode are one setting spelled twice"});
  refuse("adam_beta1 = 0.8\n", "[optimizer]\nbeta1 = 0.9\n", {"adam_beta1", "[optimizer] beta1"});
  refuse("gradient_checkpointing = true\n", "[checkpointing]\nevery = 2\n",
         {"gradient_checkpointing", "[checkpointing] table"});
  refuse("bf16 = true\nfp16 = true\n", "", {"fp16 and bf16 are both true"});
  refuse("bf16 = \"yes\"\n", "", {"[train] bf16", "takes true or false", "\"yes\""});
  refuse("adam_beta1 = \"big\"\n", "", {"[train] adam_beta1", "takes a number"});
  refuse("optim = \"adamw_apex_fused\"\n", "",
         {"optim = \"adamw_apex_fused\" has no loom optimizer", "adamw_torch_fused", "adafactor"});
  refuse("save_strategy = \"epoch\"\n", "", {"save_strategy = \"epoch\"", "\"steps\"", "\"no\""});
  EXPECT_THROW_WITH(Trainer::from_text(job(dir.str(), "", ""), dir.path(), {"train.logging_steps=-1"}),
                    ConfigError, "logging_steps must be >= 0");
}

// num_train_epochs counts the steps as the Trainer does: 64 samples in batches of 4 are 16
// batches, 8 optimizer steps with accumulation 2, so 1.5 epochs are ceil(12) = 12 steps, and
// the run (schedule included: a warm-up ratio and a linear decay over them) is the one written
// with max_steps = 12. A max_steps the job sets wins.
TEST(TrainerNames, NumTrainEpochsCountsStepsAsTheTrainer) {
  TempDir a, b, c;
  const std::string common = "gradient_accumulation_steps = 2\nlr_scheduler_type = \"linear\"\n"
                             "warmup_ratio = 0.25\n";
  auto strip_max_steps = [](std::string text) {
    return text.replace(text.find("max_steps = 4\n"), 14, "");
  };
  auto by_epochs = Trainer::from_text(strip_max_steps(job(a.str(), common + "num_train_epochs = 1.5\n", "")),
                                      a.path());
  EXPECT_NE(by_epochs->describe().find("epochs     1.5"), std::string::npos) << by_epochs->describe();
  auto by_steps = Trainer::from_text(strip_max_steps(job(b.str(), common + "max_steps = 12\n", "")), b.path());
  const RunSummary epochs_run = by_epochs->run(), steps_run = by_steps->run();
  EXPECT_EQ(epochs_run.steps, 12);
  EXPECT_EQ(steps_run.steps, 12);
  EXPECT_EQ(epochs_run.final_loss, steps_run.final_loss);
  auto both = Trainer::from_text(job(c.str(), common + "num_train_epochs = 3.0\n", ""), c.path());
  EXPECT_EQ(both->run().steps, 4);  // max_steps = 4 in the job
  TempDir d;
  EXPECT_THROW_WITH(Trainer::from_text(job(d.str(), "num_train_epochs = -1.0\n", ""), d.path()),
                    ConfigError, "num_train_epochs must be >= 0");
}

// data_seed seeds the data order alone: equal to seed, the run is seed's; another value draws
// another order (the model's initialisation stays seed's).
TEST(TrainerNames, DataSeedSeedsTheDataOrderAlone) {
  auto final_loss = [](const std::string& extra) {
    TempDir dir;
    return Trainer::from_text(job(dir.str(), extra, ""), dir.path())->run().final_loss;
  };
  const double plain = final_loss("");  // seed = 7
  EXPECT_EQ(final_loss("data_seed = 7\n"), plain);
  EXPECT_NE(final_loss("data_seed = 2\n"), plain);
}

}  // namespace
}  // namespace loom
