// The fatal-signal report (Note [Fatal signals]).
#include "meshtrain/util/fatal_signal.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/uio.h>
#include <ucontext.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace meshtrain::util {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

char who_text[160];
char executable[512];
// The context, with a sequence number that is odd while it is written: the
// handler takes a copy only when the number is even and the same after it.
char context_text[96];
std::atomic<unsigned> context_sequence{0};
std::atomic<bool> reporting{false}, reported{false};

// A copy of the context for the handler; empty if a writer kept it busy.
void read_context(char (&copy)[96]) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const unsigned before = context_sequence.load(std::memory_order_acquire);
    if (before % 2 != 0) continue;
    for (size_t i = 0; i < sizeof copy; ++i) copy[i] = reinterpret_cast<volatile char*>(context_text)[i];
    std::atomic_thread_fence(std::memory_order_acquire);
    if (context_sequence.load(std::memory_order_relaxed) == before) {
      copy[sizeof copy - 1] = '\0';
      return;
    }
  }
  copy[0] = '\0';
}

void put(const char* text) {
  for (size_t left = std::strlen(text); left > 0;) {
    const ssize_t wrote = write(STDERR_FILENO, text, left);
    if (wrote <= 0) return;
    text += wrote;
    left -= static_cast<size_t>(wrote);
  }
}

void put_number(unsigned long value, int base) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = "0123456789abcdef"[value % static_cast<unsigned long>(base)];
    value /= static_cast<unsigned long>(base);
  } while (value > 0 && n < 23);
  char text[24];
  for (int i = 0; i < n; ++i) text[i] = digits[n - 1 - i];
  text[n] = '\0';
  put(text);
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGSEGV: return "Segmentation fault";
    case SIGBUS: return "Bus error";
    case SIGFPE: return "Floating-point exception";
    case SIGILL: return "Illegal instruction";
    case SIGABRT: return "Aborted";
  }
  return "Fatal signal";
}

// A fault at address 0 with the instruction pointer there too is a jump to a
// null function pointer: glibc's backtrace stops at that frame. Where it was a
// call, the word on top of the stack is its return address, the call's place
// (after a tail call, the caller's caller's; after a return to a zeroed
// address, any word). The word is read with process_vm_readv, which answers
// EFAULT where a plain read would fault again inside the handler.
void put_null_call_caller(const siginfo_t* info, const void* machine) {
#if defined(__x86_64__)
  if (info == nullptr || machine == nullptr || info->si_code <= 0) return;
  const auto* registers = static_cast<const ucontext_t*>(machine)->uc_mcontext.gregs;
  const auto pc = static_cast<unsigned long>(registers[REG_RIP]);
  if (pc >= 4096 || pc != reinterpret_cast<unsigned long>(info->si_addr)) return;
  void* caller[1] = {nullptr};
  iovec local{caller, sizeof caller[0]};
  iovec remote{reinterpret_cast<void*>(registers[REG_RSP]), sizeof caller[0]};
  if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof caller[0])) return;
  put("meshtrain: a jump to a null function pointer; the return address on the stack (a call's place):\n");
  backtrace_symbols_fd(caller, 1, STDERR_FILENO);
#else
  (void)info;
  (void)machine;
#endif
}

void on_fatal_signal(int signal, siginfo_t* info, void* machine) {
  if (!reporting.exchange(true)) {  // one report, even if the report itself faults
    put("meshtrain: ");
    if (who_text[0] != '\0') {
      put(who_text);
      put(": ");
    }
    put(signal_name(signal));
    put(" (signal ");
    put_number(static_cast<unsigned long>(signal), 10);
    put(")");
    if (info != nullptr && info->si_code <= 0) {  // kill, raise, abort: sent, not a fault
      put(" sent by process ");
      put_number(static_cast<unsigned long>(info->si_pid), 10);
    } else if (info != nullptr) {
      put(" at address 0x");
      put_number(reinterpret_cast<unsigned long>(info->si_addr), 16);
    }
    char context[96];
    read_context(context);
    if (context[0] != '\0') {
      put(" during ");
      put(context);
    }
    put("\n");
    put_null_call_caller(info, machine);
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
    if (executable[0] != '\0') {
      put("meshtrain: to name this program's frames: addr2line -C -f -e ");
      put(executable);
      put(" followed by their +0x offsets\n");
    }
    reported.store(true);
  } else {
    // Another thread reports (the threads of one parallel kernel fault
    // together): let it finish before this one ends the process.
    for (int wait = 0; wait < 100 && !reported.load(); ++wait) {
      const timespec pause{0, 50 * 1000 * 1000};
      nanosleep(&pause, nullptr);
    }
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(signal, &fallback, nullptr);
  raise(signal);  // delivered on return: the default action, as without this handler
}

void copy_into(char* to, size_t size, const std::string& text) {
  const size_t n = std::min(size - 1, text.size());
  std::memcpy(to, text.data(), n);
  to[n] = '\0';
}

}  // namespace

std::string launcher_rank_and_host() {
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string rank;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') {
      rank = value;
      break;
    }
  }
  return (rank.empty() ? "" : "rank " + rank + " ") + "on " + host;
}

void install_fatal_signal_report(const std::string& who) {
  copy_into(who_text, sizeof who_text, who.empty() ? launcher_rank_and_host() : who);
  const ssize_t n = readlink("/proc/self/exe", executable, sizeof executable - 1);
  executable[n > 0 ? n : 0] = '\0';
  void* frame[1];
  backtrace(frame, 1);  // loads what backtrace needs now, not inside the handler
  static char alternate_stack[64 * 1024];
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (const int signal : kSignals) sigaddset(&action.sa_mask, signal);  // no nesting inside the report
  for (const int signal : kSignals) sigaction(signal, &action, nullptr);
}

void set_fatal_signal_context(const std::string& context) {
  context_sequence.fetch_add(1, std::memory_order_acq_rel);  // odd: being written
  copy_into(context_text, sizeof context_text, context);
  context_sequence.fetch_add(1, std::memory_order_release);
}

}  // namespace meshtrain::util
