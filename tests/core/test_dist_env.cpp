// Who a process is from its launcher's environment (core/src/dist_env.h): Slurm's compressed
// task counts and hostlists in the forms Slurm's documentation gives, and detect_dist_env under
// srun, torchrun and PMIx-shaped environments on several nodes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dist_env.h"
#include "loom/error.h"
#include "slurm_env.h"
#include "test_util.h"

namespace loom {
namespace {

std::vector<int> counts(const std::string& text) {
  return parse_slurm_task_counts(text, "SLURM_STEP_TASKS_PER_NODE");
}
std::vector<std::string> hosts(const std::string& text) {
  return expand_slurm_hostlist(text, "SLURM_STEP_NODELIST");
}

TEST(SlurmTaskCounts, CompressedFormsExpandNodeByNode) {
  EXPECT_EQ(counts("4"), std::vector<int>({4}));
  EXPECT_EQ(counts("4(x2)"), std::vector<int>({4, 4}));
  EXPECT_EQ(counts("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(counts("1,2(x2),3"), std::vector<int>({1, 2, 2, 3}));
  EXPECT_EQ(counts("16,8"), std::vector<int>({16, 8}));
}

TEST(SlurmTaskCounts, MalformedCountsNameTheVariableAndValue) {
  for (const std::string bad : {"", "4(x)", "(x2)", "4(x2", "4(2)", "4(x0)", "0", "-1", "4,",
                                ",4", "4,,2", "a", "4 ", "4(x2)x", "1234567890"})
    EXPECT_THROW_WITH(counts(bad), ConfigError, "SLURM_STEP_TASKS_PER_NODE='" + bad + "'",
                      "Slurm task counts");
  EXPECT_THROW_WITH(counts("1(x999999999)"), ConfigError, "more than");
}

TEST(SlurmHostlist, RangesExpandInOrderKeepingTheirWidth) {
  using Hosts = std::vector<std::string>;
  EXPECT_EQ(hosts("node[01-04,07]"), Hosts({"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(hosts("gpu-a[1-2],gpu-b3"), Hosts({"gpu-a1", "gpu-a2", "gpu-b3"}));
  EXPECT_EQ(hosts("n[1-2]-ib"), Hosts({"n1-ib", "n2-ib"}));
  EXPECT_EQ(hosts("a[08-11]"), Hosts({"a08", "a09", "a10", "a11"}));
  EXPECT_EQ(hosts("x[8-10]"), Hosts({"x8", "x9", "x10"}));
  EXPECT_EQ(hosts("c[5]"), Hosts({"c5"}));
  EXPECT_EQ(hosts("c[007,3]"), Hosts({"c007", "c3"}));
  EXPECT_EQ(hosts("host1,host2"), Hosts({"host1", "host2"}));
  EXPECT_EQ(hosts("login"), Hosts({"login"}));
  EXPECT_EQ(hosts("r[1-2]n[1-2]"), Hosts({"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(hosts("[1-2]x"), Hosts({"1x", "2x"}));
  EXPECT_EQ(hosts("a.b-c_d[1,3],e"), Hosts({"a.b-c_d1", "a.b-c_d3", "e"}));
}

TEST(SlurmHostlist, MalformedListsNameTheVariableAndValue) {
  for (const std::string bad : {"", "node[04-01]", "node[1-", "node[]", "node[1-2", "node1]",
                                "node[[1]]", "node[a-b]", "node[1-2-3]", "node[-2]", "node[1,]",
                                "a,,b", "a,", ",a", "a b", "n[1 -2]", "n[1-1234567890]"})
    EXPECT_THROW_WITH(hosts(bad), ConfigError, "SLURM_STEP_NODELIST='" + bad + "'",
                      "Slurm hostlist");
  EXPECT_THROW_WITH(hosts("node[04-01]"), ConfigError, "counts down");
  EXPECT_THROW_WITH(hosts("node[1-"), ConfigError, "never closed");
  EXPECT_THROW_WITH(hosts("n[0-999999999]"), ConfigError, "more than");
  EXPECT_THROW_WITH(hosts("r[1-2000]n[1-2000]"), ConfigError, "more than");
}

// Sets a launcher's variables for one test, with every other launcher variable unset; the
// process's own values come back at the end.
class LauncherEnv {
 public:
  explicit LauncherEnv(const std::map<std::string, std::string>& values) {
    for (const char* name : kNames) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      unsetenv(name);
    }
    for (const auto& [name, value] : values) {
      EXPECT_TRUE(saved_.count(name)) << name << " is missing from LauncherEnv's list";
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~LauncherEnv() {
    for (const auto& [name, value] : saved_)
      value ? setenv(name.c_str(), value->c_str(), 1) : unsetenv(name.c_str());
  }
  LauncherEnv(const LauncherEnv&) = delete;
  LauncherEnv& operator=(const LauncherEnv&) = delete;

 private:
  static constexpr const char* kNames[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
      "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
      "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
      "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
      "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
      "SLURM_JOB_ID", "PMIX_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
  std::map<std::string, std::optional<std::string>> saved_;
};

// Rank 5 of `srun -N 2 -n 6 --ntasks-per-node=...` as srun sets it: 4 tasks on node 0, 2 on
// node 1; `extra` replaces or adds variables.
std::map<std::string, std::string> srun_second_node(std::map<std::string, std::string> extra = {}) {
  std::map<std::string, std::string> values = {
      {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_NODEID", "1"},
      {"SLURM_LOCALID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4,2"},
      {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_STEP_NODELIST", "gpu[07-08]"},
      {"SLURM_JOB_NODELIST", "gpu[01,07-08]"}, {"SLURM_JOB_ID", "4242"}};
  for (auto& [name, value] : extra) values[name] = value;
  return values;
}

// The launcher, rank / world size and local rank / local world size detect_dist_env found.
std::string who(const DistEnv& env) {
  return detail::cat(env.launcher, " rank ", env.rank, "/", env.world_size, ", local ",
                     env.local_rank, "/", env.local_world_size);
}

TEST(DistEnv, SrunOnTwoNodesTakesTheNodesCountAndTheStepsFirstHost) {
  LauncherEnv launcher(srun_second_node());
  const DistEnv env = detect_dist_env();
  EXPECT_EQ(who(env), "slurm rank 5/6, local 1/2");  // the step's counts, not the job's 4(x2)
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.master_addr, "gpu07");  // the step's first host, not the job's
  EXPECT_EQ(env.master_addr_from, "SLURM_STEP_NODELIST");
  EXPECT_EQ(env.master_port, 10000 + 4242);
  EXPECT_EQ(env.master_port_from, "SLURM_JOB_ID");
  const std::string said = describe_derived_rendezvous(env);
  for (const std::string part : {"MASTER_ADDR = gpu07, the first host of SLURM_STEP_NODELIST",
                                 "MASTER_PORT = 14242 from SLURM_JOB_ID", "rank 5 of 6 on node 1"})
    EXPECT_NE(said.find(part), std::string::npos) << said;
  EXPECT_NO_THROW(check_rendezvous_address(env));
}

TEST(DistEnv, SrunCompressedCountsAndTheJobsListsServeWithoutTheSteps) {
  LauncherEnv launcher(srun_second_node({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}));
  unsetenv("SLURM_STEP_NODELIST");
  DistEnv env = detect_dist_env();
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "gpu01");
  EXPECT_EQ(env.master_addr_from, "SLURM_JOB_NODELIST");

  unsetenv("SLURM_STEP_TASKS_PER_NODE");  // SLURM_TASKS_PER_NODE=4(x2)
  setenv("SLURM_LOCALID", "3", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_PROCID", "7", 1);
  EXPECT_EQ(detect_dist_env().local_world_size, 4);

  unsetenv("SLURM_TASKS_PER_NODE");  // --ntasks-per-node's number holds on every node
  setenv("SLURM_NTASKS_PER_NODE", "4", 1);
  EXPECT_EQ(detect_dist_env().local_world_size, 4);
}

TEST(DistEnv, GivenMasterAddrAndPortWinAndOneNodeKeepsLoopback) {
  {
    LauncherEnv launcher(srun_second_node({{"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29511"},
                                           {"SLURM_STEP_NODELIST", "not[a-list"}}));
    const DistEnv env = detect_dist_env();  // the node list is not read at all
    EXPECT_EQ(env.master_addr, "10.0.0.9");
    EXPECT_EQ(env.master_addr_from, "MASTER_ADDR");
    EXPECT_EQ(env.master_port, 29511);
    EXPECT_EQ(describe_derived_rendezvous(env), "");
  }
  LauncherEnv launcher({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                        {"SLURM_STEP_TASKS_PER_NODE", "4"}, {"SLURM_STEP_NODELIST", "gpu07"}});
  const DistEnv env = detect_dist_env();
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_addr_from, "");
  EXPECT_EQ(env.master_port, 29500);  // no SLURM_JOB_ID: the default
}

TEST(DistEnv, InconsistentSlurmVariablesNameTheVariable) {
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_NODEID", "2"}}));
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_NODEID=2",
                      "SLURM_STEP_TASKS_PER_NODE='4,2'", "2 node(s)");
  }
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_NODEID", "2"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                           {"SLURM_PROCID", "4"}, {"SLURM_LOCALID", "0"}}));
    unsetenv("SLURM_STEP_TASKS_PER_NODE");
    unsetenv("SLURM_TASKS_PER_NODE");
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_NODEID=2",
                      "SLURM_STEP_NODELIST='gpu[07-08]'", "2 host(s)");
  }
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_STEP_TASKS_PER_NODE", "4(x)"}}));
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_STEP_TASKS_PER_NODE='4(x)'");
  }
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_STEP_TASKS_PER_NODE", "4,4"}}));
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_STEP_TASKS_PER_NODE='4,4' counts 8",
                      "SLURM_NTASKS=6");
  }
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_STEP_NODELIST", "gpu[08-07]"}}));
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_STEP_NODELIST='gpu[08-07]'");
  }
  {
    LauncherEnv launcher(srun_second_node({{"SLURM_JOB_ID", "12x"}}));
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "SLURM_JOB_ID='12x'");
  }
  {  // srun set no node list: the rendezvous check says what to set
    LauncherEnv launcher(srun_second_node());
    unsetenv("SLURM_STEP_NODELIST");
    unsetenv("SLURM_JOB_NODELIST");
    const DistEnv env = detect_dist_env();
    EXPECT_THROW_WITH(check_rendezvous_address(env), ConfigError, "MASTER_ADDR is not set",
                      "scontrol show hostnames");
  }
}

TEST(DistEnv, TorchrunOnSeveralNodesReadsItsGroupRank) {
  LauncherEnv launcher({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"}, {"NODE_RANK", "7"},
                        {"MASTER_ADDR", "node01"}, {"MASTER_PORT", "29400"},
                        {"TORCHELASTIC_RESTART_COUNT", "2"},
                        {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                        {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});  // torchrun inside srun
  DistEnv env = detect_dist_env();
  EXPECT_EQ(env.launcher, "torchrun");
  // torchrun's agent serves the store already (rank 0 joins it), and the restart it is on.
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 2);
  EXPECT_EQ(env.node_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 29400);
  unsetenv("GROUP_RANK");
  EXPECT_EQ(detect_dist_env().node_rank, 7);
  setenv("NODE_RANK", "one", 1);
  EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "NODE_RANK='one'");
}

TEST(DistEnv, PmixOnlyLaunchesUseItsSizesOrSayWhatIsMissing) {
  {
    LauncherEnv launcher({{"PMIX_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"},
                          {"MPI_LOCALNRANKS", "2"}});
    const DistEnv env = detect_dist_env();
    EXPECT_EQ(who(env), "pmix rank 3/4, local 1/2");
  }
  {
    LauncherEnv launcher(std::map<std::string, std::string>{{"PMIX_RANK", "3"}});
    EXPECT_THROW_WITH(detect_dist_env(), ConfigError, "PMIX_RANK=3", "number of ranks");
  }
  {  // Open MPI sets PMIX_RANK beside its own names, and srun --mpi=pmix beside Slurm's
    LauncherEnv launcher({{"PMIX_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    EXPECT_EQ(detect_dist_env().launcher, "openmpi");
  }
  LauncherEnv launcher(srun_second_node({{"PMIX_RANK", "5"}}));
  EXPECT_EQ(detect_dist_env().launcher, "slurm");
}

}  // namespace
}  // namespace loom
