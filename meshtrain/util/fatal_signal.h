// One line and a stack when a rank dies on a fatal signal (Note [Fatal signals]).
#pragma once

#include <string>

namespace meshtrain::util {

// Note [Fatal signals]
// A rank that dies on SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT used to leave
// only what its launcher says ("exited on signal 11", a task number) and, after
// MPI_Init, Open MPI's stack with a host and pid but no rank. The handler
// prints one line first,
//   meshtrain: rank 1 on node2: Segmentation fault (signal 11) at address 0x0 during step 12
// ("sent by process P" in place of the address for a signal sent by kill,
// raise or abort),
// then, for a jump to a null function pointer (the instruction at address 0,
// where glibc's backtrace stops), the return address on top of the stack (a
// call's place; x86-64), then the stack (glibc's backtrace: the dynamic table's
// symbols, else an offset into the program that the addr2line command printed
// after it names). Then it puts the signal's default action back and raises it
// again, so the exit status and any core dump are what they were without it. It
// is installed at the start of main (a rank from the launcher's variables: Open
// MPI's, PMIx's, Slurm's) and again once MPI is up (the world rank; this also
// takes the signals back from Open MPI, whose own report would repeat the
// stack). The step ("step 12"; before the first, "MPI_Init_thread" or "start-up
// (config, data, model)") is the watchdog's context (Watchdog::set_context),
// copied into a fixed buffer under a sequence number, so the handler reads it
// without a lock or an allocation. Threads that fault together (one parallel
// kernel) give one report: the others wait for it before the process ends, and
// the fatal signals are blocked while a report is printed.
// Everything the handler calls is async-signal-safe except backtrace(), which
// is called once at installation so that it does not load libgcc inside the
// handler. A stack overflow reports on an alternate signal stack (the
// installing thread's).

// Installs the handler; `who` names this process, e.g. "rank 3 on node2"
// (empty: the launcher's rank variable and this host's name). Repeatable.
void install_fatal_signal_report(const std::string& who = "");

// What the process is doing, e.g. "step 12" (empty: nothing); at most 95
// characters are kept. Callers serialise (the watchdog holds its lock).
void set_fatal_signal_context(const std::string& context);

// "rank R on HOST" from the launcher's variables and gethostname, or "on HOST"
// without them (exposed for tests).
std::string launcher_rank_and_host();

}  // namespace meshtrain::util
