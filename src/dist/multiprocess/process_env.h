// Environment and option parsing shared by the process backends (mpi, gloo).
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace funcol::process {

// True when FUNCOL_DEBUG is "detail" (case-insensitive): cross-rank signature checks before
// every collective, as TORCH_DISTRIBUTED_DEBUG=DETAIL. False when unset, empty, OFF or INFO;
// any other value is an InvalidArgument naming it (as PyTorch refuses one).
bool debug_detail();
// The ranks of a job found that they differ in debug_detail(): "rank P runs with[out]
// FUNCOL_DEBUG=DETAIL and this rank (rank R) without it|with it; every rank of a job must set
// the same FUNCOL_DEBUG", for the backends' errors (a rank with it exchanges each collective's
// signature first, which a rank without would take as data).
std::string debug_detail_mismatch(int peer, int rank, bool mine);

// An integer environment variable; nullopt when unset or empty. Throws InvalidArgument naming
// the variable when it is not an integer.
std::optional<int> env_int(const char* name);

// A string environment variable, or "" when unset.
std::string env_string(const char* name);

// `timeout` when positive, else default_timeout() (FUNCOL_TIMEOUT or 300 s).
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds timeout);

// Where rendezvous happens: file:///dir, a bare directory DIR (the same as file://DIR; a relative
// one is made absolute against the working directory) or redis://host[:port].
struct StoreUrl {
  enum class Kind { File, Redis } kind = Kind::File;
  std::string path;  // File
  std::string host;  // Redis
  int port = 6379;   // Redis (Redis's default port)
  std::string text;  // as given, for messages
};
// Throws InvalidArgument "invalid store 'x': ..." for anything else: an empty string, a scheme
// other than file:// and redis:// ("unknown scheme"), a relative file:// directory.
StoreUrl parse_store_url(const std::string& url);

// This process, as another process of its job on the same machine can tell whether it still
// runs: "<host>/<boot id>/<pid namespace>[+<time namespace>]/<device of /proc>/<pid>/<start
// time>" (no spaces).
// Empty when /proc cannot say.
std::string process_identity();
// What /proc says of the process that `identity` (another process's process_identity()) names:
// true while it runs; false once its pid is gone, a zombie, or taken by a process started
// later; nullopt when that cannot be known (another machine, namespace or /proc, an empty or
// malformed identity, /proc unreadable). A "false" for an identity never seen "true" proves
// little (a record copied from elsewhere, clock or namespace differences): callers act on a
// process they saw running that ended.
std::optional<bool> process_running(const std::string& identity);
// Whether process `pid` of this machine runs: false once it ended (gone, a zombie not yet
// reaped, or dead), true otherwise (also when /proc cannot say).
bool process_live(int pid);
// Records this process as the one that runs a process backend (init_process_group, MPI's
// start). A child it forks without exec has a copy of that state whose threads are gone and
// whose sockets it shares with its parent: its exit handlers must not drain its collectives,
// say goodbye for the rank (the peers then failed the living rank as departed) or finalise MPI
// (waiting on a communication thread the child does not have).
void note_backend_owner();
// True in a child of the process that called note_backend_owner (forked, not exec'd).
bool forked_from_backend_owner();
// The variables a funcol launcher passes to the ranks it starts: its pid, to the gloo ranks it
// starts itself (`funcol run`, `bench` and `train` with --backend gloo, funcol-gloo-launch),
// and to the ranks of an mpirun job it started (mpirun's children, not its own).
inline constexpr const char* kLauncherPidVar = "FUNCOL_LAUNCHER_PID";
inline constexpr const char* kMpiLauncherPidVar = "FUNCOL_MPI_LAUNCHER_PID";
// And the PID namespace that pid is in (pid_namespace()): a rank in another one cannot see it.
inline constexpr const char* kLauncherPidNamespaceVar = "FUNCOL_LAUNCHER_PIDNS";
// This process's PID namespace as /proc names it ("pid:[4026531836]"), or "" when it cannot.
std::string pid_namespace();
// For a rank a launcher started (either variable set): the rank exits when its launcher is
// gone, so a launcher killed with SIGKILL, which cannot stop its ranks, leaves none behind
// (mpirun, which outlives it, then ends its job as for a crashed rank). A child of the launcher
// dies with it (PR_SET_PDEATHSIG); a rank started through a wrapper (`sh -c ...`) or by mpirun
// watches it from a thread and says why it stops. A rank whose launcher is gone already exits
// at once. A rank in another PID namespace than its launcher's (`unshare --pid`, a container:
// FUNCOL_LAUNCHER_PIDNS differs, or its parent is outside its namespace) does not follow it, as
// the launcher's pid means nothing there. PR_SET_PDEATHSIG follows the thread that started the
// rank: a launcher must start its ranks from a thread that lives as long as it does (funcol's
// do, from the main thread). Does nothing when neither variable is set, or the second time; a
// value that is not a pid is an InvalidArgument naming the variable, before anything is
// followed. init_process_group calls it.
void follow_launcher();
// The pid field of an identity (process_identity's format), as /proc numbers it on the
// identity's machine; empty when the identity is malformed.
std::string identity_pid(const std::string& identity);

}  // namespace funcol::process
