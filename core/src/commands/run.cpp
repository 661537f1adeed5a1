// `loom run` and `loom check` start here: the job parsed, its batch chosen when [train]
// auto_find_batch_size asks (Note [Auto batch size]: the estimator's probe runs, before the
// trainer is made), then prepared once (Note [One resolved job]) and handed to the engine.
#include "engine_factory.h"
#include "job.h"
#include "loom/trainer.h"

namespace loom {

std::unique_ptr<Trainer> Trainer::from_file(const std::filesystem::path& job,
                                            const std::vector<std::string>& overrides) {
  return make_trainer(with_auto_batch(Job::load(job, overrides)));
}

std::unique_ptr<Trainer> Trainer::from_text(const std::string& toml,
                                            const std::filesystem::path& dir,
                                            const std::vector<std::string>& overrides) {
  return make_trainer(with_auto_batch(Job::parse(toml, dir / "job.toml", overrides)));
}

}  // namespace loom
