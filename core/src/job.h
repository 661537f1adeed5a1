// job.h (core-internal) — a job file parsed from TOML (plus --set overrides) into loom's
// ConfigValue tree, with every value's file:line. Validation against the plugins' schemas is
// resolve.h's job.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <string>
#include <vector>

#include "loom/config.h"

namespace loom {

struct Job {
  std::filesystem::path file;           // as given
  std::filesystem::path dir;            // the job file's folder (relative paths start here)
  ConfigValue root;                     // a table of tables
  std::vector<std::string> overrides;   // --set key=value, in order
  std::string text;                     // the TOML as read, before the overrides
  std::vector<std::string> notes;       // the Trainer's names and a DeepSpeed file's keys
                                        // rewritten (Notes [Trainer names], [DeepSpeed config files])
  std::vector<std::string> warnings;    // a DeepSpeed file's keys that change nothing here

  // Throws ConfigError naming file:line for a syntax error, an unreadable file, or a top-level
  // key outside a table; and for a malformed --set.
  static Job load(const std::filesystem::path& file,
                  const std::vector<std::string>& overrides = {});
  static Job parse(const std::string& text, const std::filesystem::path& name,
                   const std::vector<std::string>& overrides = {});

  const ConfigValue* table(std::string_view name) const { return root.find(name); }
  std::vector<std::string> table_names() const;
  // Canonical text of all values (sorted), hashed into checkpoints' config_hash (less the keys
  // that change nothing trained: [train] output_dir, resume, progress_bar, log_level,
  // log_all_ranks).
  std::string canonical_text() const;
  std::string hash() const;  // 16 hex digits
};

// The parsed job's tables, for the rewrites of other spellings (Notes [Trainer names],
// [DeepSpeed config files]): [table] key removed and returned (nullopt when absent); [name],
// made empty at `where` unless the job has it (a ConfigError when it is not a table).
std::optional<ConfigValue> take_key(ConfigValue& root, std::string_view table, std::string_view key);
ConfigValue& table_of(ConfigValue& root, const std::string& name, const std::string& where);

// A value for people to read: as to_text, but numbers in their shortest exact form (5e-05, not
// 5.0000000000000002e-05). to_text stays exact and fixed: the config hash is made of it.
std::string display_text(const ConfigValue& value);

class Trainer;
// A Trainer for a parsed job, as Trainer::from_file makes one (engine.cpp).
std::unique_ptr<Trainer> make_trainer(Job job);
// [train] auto_find_batch_size (Note [Auto batch size] in estimate.cpp): the job with the
// per-device batch and accumulation that fit its memory budget set by overrides; the job itself
// when the key is off.
Job with_auto_batch(Job job);

}  // namespace loom
