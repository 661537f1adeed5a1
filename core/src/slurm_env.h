// slurm_env.h (core-internal) — the compressed lists in the environment srun gives each task,
// read without Slurm's library (loom links none). Both throw ConfigError naming `variable` and
// the value when the text is malformed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace loom {

// Tasks on each node of a step or job, in node-list order, from SLURM_STEP_TASKS_PER_NODE's
// form: counts separated by commas, "N(xK)" for K nodes of N tasks each. "2(x3),1" -> 2,2,2,1.
std::vector<int> parse_slurm_task_counts(std::string_view text, std::string_view variable);

// The hosts a Slurm hostlist names, in its order: names separated by commas, each with
// bracketed ranges and single numbers ("node[01-04,07]", "n[1-2]-ib", "r[1-2]n[1-2]"); a
// range's numbers keep the width of its first ("a[08-11]" -> a08..a11).
std::vector<std::string> expand_slurm_hostlist(std::string_view text, std::string_view variable);

}  // namespace loom
