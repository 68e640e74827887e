#include "meshtrain/train/matmul_peak.h"

#include <nlohmann/json.hpp>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>

#include "meshtrain/util/memory.h"
#include "meshtrain/util/cpu_features.h"
#include "meshtrain/util/files.h"

namespace meshtrain::train {

// Note [Matmul peak]
// ~~~~~~~~~~~~~~~~~~
// MFU divides a step's FLOP/s by the matmul rate of the machine. Measuring it
// costs a CPU rank about a second (2048-wide products, best of 3), and every
// training process paid it at start: four ranks sharing two cores waited two
// seconds before their first step, and the test suite, which starts training
// processes by the hundred, paid minutes. On a CPU the rate is a fact of the
// machine, so it is kept in a cache file keyed by host, processor, kernels,
// threads and dtype; a training process measures only where the file has no
// entry for it. The measuring commands (`bench train`, `plan --calibrate`)
// measure afresh and merge their figure as the best seen, so a first figure
// taken while other work shared the cores is raised by the next taken on a
// quiet machine (delete the file to start over). Writers take the file's lock
// and replace it whole; a file that cannot be read or written changes nothing
// but the cost. A GPU is measured in each process, as before: its 8192³
// products take milliseconds, and a device index names no model.
namespace {

using Clock = std::chrono::steady_clock;

double measure(at::Device device, at::ScalarType dtype) {
  const bool gpu = device.is_cuda();
  // A measurement, not training memory: on the CPU neither counted nor held to memory.limit_mb.
  const memory::HostScope uncounted;
  const at::TensorOptions options = at::TensorOptions().device(device).dtype(dtype);
  double best_rate = 0;
  // Up to 2048 on a CPU: a 1024 product reaches only ~60% of the peak there, which would overstate MFU.
  for (const int64_t n : gpu ? std::vector<int64_t>{8192} : std::vector<int64_t>{256, 512, 1024, 2048}) {
    const int repeats = gpu ? 10 : 1;
    // Filled without drawing random numbers: the training's random streams stay where they are.
    at::Tensor a = at::linspace(-1, 1, n * n, options).view({n, n}), b = a.t().contiguous(), c = at::empty({n, n}, options);
    auto start = Clock::now();
    at::mm_out(c, a, b);
    c.sum().item<double>();
    double best = std::chrono::duration<double>(Clock::now() - start).count();
    const bool slow = best > 0.5;
    for (int i = 0; i < 3 && !slow; ++i) {
      c.sum().item<double>();  // waits for the queue on a GPU
      start = Clock::now();
      for (int r = 0; r < repeats; ++r) at::mm_out(c, a, b);
      c.sum().item<double>();
      best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count() / repeats);
    }
    best_rate = std::max(best_rate, 2.0 * n * n * n / best);
    if (slow) break;
  }
  return best_rate;
}

// What the rate depends on, as the cache file's key.
std::string machine_key(at::Device device, at::ScalarType dtype) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string processor = device.is_cuda() ? "cuda" : util::cpu_model_name();
  if (device.is_cuda()) {
    processor += ":" + std::to_string(device.index());
  } else {
    processor += std::string(" ") + util::cpu_kernels_name() + (util::cpu_has_amx() ? "+amx" : "") + " threads " +
                 std::to_string(at::get_num_threads());
  }
  return std::string(host) + " | " + processor + " | " + std::string(c10::toString(dtype));
}

nlohmann::json read_cache(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() ? j : nlohmann::json::object();
}

// The rate the cache holds for `key`; 0 where it holds none.
double kept(const nlohmann::json& cache, const std::string& key) {
  const auto found = cache.find(key);
  return found != cache.end() && found->is_number() ? found->get<double>() : 0;
}

// Merges `rate` into the file as the best seen for `key`, under the file's lock.
void store(const std::string& path, const std::string& key, double rate) {
  try {
    util::make_directories(path.substr(0, path.rfind('/')));
  } catch (const std::exception&) {
    return;  // not kept: the next process measures again
  }
  const int lock = open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return;
  flock(lock, LOCK_EX);
  nlohmann::json cache = read_cache(path);
  if (kept(cache, key) < rate) {
    cache[key] = rate;
    try {
      util::write_text_file(path, cache.dump(1) + "\n");  // whole, through a renamed temporary
    } catch (const std::exception&) {
    }
  }
  close(lock);  // releases the lock
}

}  // namespace

std::string matmul_peak_cache_path() {
  for (const char* name : {"MESHTRAIN_CACHE", "XDG_CACHE_HOME", "HOME"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    const std::string dir = value;
    if (std::string(name) == "MESHTRAIN_CACHE") return dir + "/matmul-peak.json";
    return dir + (std::string(name) == "HOME" ? "/.cache" : "") + "/meshtrain/matmul-peak.json";
  }
  return "";
}

double measure_matmul_peak(at::Device device, at::ScalarType dtype, bool afresh) {
  static std::mutex mutex;
  static std::map<std::string, double> measured;  // this process's: a test that builds many trainers asks once
  const std::lock_guard<std::mutex> lock(mutex);
  const std::string key = machine_key(device, dtype);
  if (const auto found = measured.find(key); found != measured.end() && !afresh) return found->second;
  const std::string path = device.is_cuda() ? "" : matmul_peak_cache_path();
  if (!path.empty() && !afresh) {
    if (const double rate = kept(read_cache(path), key); rate > 0) return measured[key] = rate;
  }
  const double rate = measure(device, dtype);
  if (!path.empty()) store(path, key, rate);
  return measured[key] = rate;
}

}  // namespace meshtrain::train
