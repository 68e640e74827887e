#include "meshtrain/fl/client_pool.h"

#include "meshtrain/fl/update.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/parallel/step_engine.h"

#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <stdexcept>

namespace meshtrain::fl {

struct EnginePool::Slot {
  std::string model_json;  // the model its engine holds ("": none yet)
  std::unique_ptr<parallel::StepEngine> engine;
  bool busy = false;
};

EnginePool::EnginePool(int engines) {
  if (engines < 1) throw std::invalid_argument("a client pool needs at least one trainer");
  for (int i = 0; i < engines; ++i) slots_.push_back(std::make_unique<Slot>());
}

EnginePool::~EnginePool() = default;

EnginePool::Lease::Lease(EnginePool& pool, const std::string& model_json) : pool_(pool), slot_(nullptr) {
  {
    std::unique_lock<std::mutex> lock(pool_.mutex_);
    pool_.free_.wait(lock, [&] {
      for (auto& s : pool_.slots_)  // one that holds this model already, else any free one
        if (!s->busy && s->model_json == model_json) return slot_ = s.get(), true;
      for (auto& s : pool_.slots_)
        if (!s->busy) return slot_ = s.get(), true;
      return false;
    });
    slot_->busy = true;
  }
  if (slot_->model_json != model_json) {  // built outside the lock: the other trainers go on
    slot_->engine = client_engine(model::Gpt(model::config_from_json(model_json), 0));
    slot_->model_json = model_json;
  }
}

EnginePool::Lease::~Lease() {
  std::lock_guard<std::mutex> lock(pool_.mutex_);
  slot_->busy = false;
  pool_.free_.notify_one();
}

parallel::StepEngine& EnginePool::Lease::engine() { return *slot_->engine; }

namespace {

struct Job {
  const ClientOptions* options;
  std::atomic<int>* failed;
};

void* run_pooled(void* arg) {
  std::unique_ptr<Job> job(static_cast<Job*>(arg));
  try {
    if (run_client(*job->options) != 0) ++*job->failed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fl client %s: %s\n", job->options->id.c_str(), e.what());
    ++*job->failed;
  }
  return nullptr;
}

}  // namespace

// Note [A pool of clients]: a thread per client with a small stack (it waits
// in long polls; training runs on it with a leased engine, whose deep work is
// ATen's, on its own threads or this stack's few frames). A client that cannot
// be started is reported, and the others go on.
int run_client_pool(std::vector<ClientOptions> clients, int engines) {
  EnginePool pool(engines);
  constexpr size_t kClientsPerChannel = 100;  // streams over one connection
  std::shared_ptr<grpc::Channel> channel;
  for (size_t i = 0; i < clients.size(); ++i) {
    if (i % kClientsPerChannel == 0) channel = client_channel(clients[i].server, clients[i].tls);
    clients[i].engines = &pool;
    clients[i].channel = channel;
  }
  std::atomic<int> failed{0};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 2 << 20);
  std::vector<pthread_t> threads;
  for (const ClientOptions& o : clients) {
    pthread_t t;
    auto* job = new Job{&o, &failed};
    if (pthread_create(&t, &attr, run_pooled, job) != 0) {  // the federation goes on with those started
      delete job;
      std::fprintf(stderr, "fl simulate: cannot start a thread for client %s: %zu of %zu clients take part (lower "
                   "--clients, or raise the limit on threads)\n", o.id.c_str(), threads.size(), clients.size());
      ++failed;
      break;
    }
    threads.push_back(t);
  }
  pthread_attr_destroy(&attr);
  for (pthread_t t : threads) pthread_join(t, nullptr);
  return failed.load() == 0 ? 0 : 1;
}

}  // namespace meshtrain::fl
