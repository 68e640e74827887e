#include "meshtrain/fl/client.h"

#include "meshtrain/fl/chunks.h"
#include "meshtrain/fl/client_pool.h"
#include "meshtrain/fl/dp.h"
#include "meshtrain/fl/federation.grpc.pb.h"
#include "meshtrain/fl/robust.h"
#include "meshtrain/fl/secagg.h"
#include "meshtrain/fl/transport.h"
#include "meshtrain/fl/update.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/util/files.h"

#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

namespace meshtrain::fl {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> stop_signalled{false};
extern "C" void on_stop_signal(int) { stop_signalled = true; }

std::string token_file_of(const std::string& data) {
  if (util::is_directory(data)) return data + "/train.bin";
  return data;
}

class Participant {
 public:
  explicit Participant(const ClientOptions& o)
      : o_(o), file_(std::make_unique<train::TokenFile>(token_file_of(o.data))), tokens_(file_->size()),
        rng_(at::make_generator<at::CPUGeneratorImpl>(std::random_device{}())) {
    if (o_.engines) file_.reset();  // opened again while it trains
    stub_ = wire::Federation::NewStub(o.channel ? o.channel : client_channel(o.server, o.tls));
  }
  ~Participant() { end_presence(); }

  int run() {
    join();
    while (true) {
      if (stop_signalled) {
        leave();
        return 0;
      }
      wire::Task task;
      const grpc::Status status = poll(&task);
      if (!status.ok()) {
        log("lost the server (%s); rejoining", status.error_message().c_str());
        join();
        continue;
      }
      switch (task.kind()) {
        case wire::Task::WAIT: continue;
        case wire::Task::STOP: log("stopped by the server: %s", task.message().c_str()); return 0;
        default: break;
      }
      wire::Result result;
      std::string phase;
      const auto began = Clock::now();
      try {
        phase = handle(task, result);
      } catch (const secagg::SecAggError& e) {
        log("round %llu: %s", static_cast<unsigned long long>(task.round()), e.what());
        continue;
      }
      if (phase == "fit" && o_.straggle_s > 0)
        std::this_thread::sleep_for(std::chrono::duration<double>(o_.straggle_s));
      if (phase == "fit" && o_.slow_factor > 1) std::this_thread::sleep_for((Clock::now() - began) * (o_.slow_factor - 1));
      submit(task, result);
      if (!o_.drop_after.empty() && phase == o_.drop_after) {
        log("dropping out after %s, as asked (--drop-after)", phase.c_str());
        return 3;
      }
      const bool secure = task.kind() != wire::Task::FIT || task.fit().secagg().enabled();
      const bool round_done = phase == (secure ? "unmask" : "fit");
      if (round_done && o_.leave_after > 0 && ++rounds_done_ == o_.leave_after) {
        leave();
        return 0;
      }
    }
  }

 private:
  template <typename... Args>
  void log(const char* format, Args... args) const {
    if (o_.quiet) return;
    std::string f = "fl client " + o_.id + ": " + format + "\n";
    std::fprintf(stderr, f.c_str(), args...);
  }

  void join() {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(o_.connect_timeout_s));
    std::string last;
    while (Clock::now() < deadline) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      context.set_wait_for_ready(true);  // wait for a connection rather than fail at once
      wire::JoinRequest request;
      request.set_client_id(o_.id);
      request.set_tokens(static_cast<uint64_t>(tokens_));  // the server counts them at the model's context
      request.set_resume_session(session_);  // rejoining after a lost link: the session is ours
      request.set_protocol(kProtocol);
      request.set_join_token(o_.join_token);
      wire::JoinReply reply;
      const grpc::Status status = stub_->Join(&context, request, &reply);
      if (status.ok()) {
        session_ = reply.session();
        log("joined %s with %lld training tokens", o_.server.c_str(), static_cast<long long>(tokens_));
        if (!o_.engines) start_presence();
        return;
      }
      if (status.error_code() == grpc::StatusCode::PERMISSION_DENIED)
        throw ClientError("the server at " + o_.server + " refused this client: " + status.error_message());
      // ALREADY_EXISTS (that session may be ending) and RESOURCE_EXHAUSTED (joins limited): retried until the timeout.
      last = status.error_message();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    throw ClientError("could not reach the federation server at " + o_.server + " within " +
                      std::to_string(static_cast<int>(o_.connect_timeout_s)) + " s (" + last +
                      "). Is it running? With TLS: does --ca hold the CA of the server's certificate? With mutual TLS: "
                      "is this client's certificate signed by the server's client CA?");
  }

  // The next task, as its chunks come (Note [Messages in chunks]).
  grpc::Status poll(wire::Task* task) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    wire::PollRequest request;
    request.set_client_id(o_.id);
    request.set_session(session_);
    auto reader = stub_->PollChunks(&context, request);
    wire::Chunk first;
    if (!reader->Read(&first)) return reader->Finish();
    const grpc::Status read = read_chunks(std::move(first), [&](wire::Chunk* chunk) { return reader->Read(chunk); },
                                          std::numeric_limits<int32_t>::max(), "a task", task);
    if (!read.ok()) context.TryCancel();
    const grpc::Status finished = reader->Finish();
    return read.ok() ? finished : read;
  }

  // Note [Client sessions]: one Presence call held open per session, so that
  // the server sees this process die the moment its connection closes.
  void start_presence() {
    end_presence();
    presence_context_ = std::make_unique<grpc::ClientContext>();
    wire::PollRequest request;
    request.set_client_id(o_.id);
    request.set_session(session_);
    presence_ = std::thread([this, request] {
      auto reader = stub_->Presence(presence_context_.get(), request);
      for (wire::Ack ack; reader->Read(&ack);) {
      }
      reader->Finish();
    });
  }
  void end_presence() {
    if (!presence_.joinable()) return;
    presence_context_->TryCancel();
    presence_.join();
  }

  void leave() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    wire::LeaveRequest request;
    request.set_client_id(o_.id);
    request.set_session(session_);
    wire::Ack ack;
    const grpc::Status status = stub_->Leave(&context, request, &ack);
    log("left the federation after %d rounds%s", rounds_done_, status.ok() ? "" : " (the server did not answer)");
  }

  void submit(const wire::Task& task, wire::Result& result) {
    result.set_client_id(o_.id);
    result.set_session(session_);
    result.set_round(task.round());
    result.set_kind(task.kind());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
    wire::Ack ack;
    auto writer = stub_->SubmitChunks(&context, &ack);
    write_result_chunks(result, [&](const wire::Chunk& chunk) { return writer->Write(chunk); });
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (!status.ok()) log("round %llu: result not taken: %s", static_cast<unsigned long long>(task.round()),
                          status.error_message().c_str());
    else log("round %llu: sent %s, %zu bytes", static_cast<unsigned long long>(task.round()),
             wire::Task::Kind_Name(task.kind()).c_str(), result.ByteSizeLong());
  }

  // Returns the phase name of the task it answered.
  std::string handle(const wire::Task& task, wire::Result& result) {
    switch (task.kind()) {
      case wire::Task::FIT: fit(task, result); return "fit";
      case wire::Task::SECAGG_SHARE:
        if (!secure_) throw secagg::SecAggError("a share request without a secure round in progress");
        for (auto& s : secure_->share({task.peers().begin(), task.peers().end()})) *result.add_shares() = std::move(s);
        return "share";
      case wire::Task::SECAGG_MASK: {
        if (!secure_) throw secagg::SecAggError("a mask request without a secure round in progress");
        const std::vector<uint32_t> y = secure_->mask(x_, {task.shares().begin(), task.shares().end()});
        result.set_masked(y.data(), y.size() * sizeof(uint32_t));
        return "mask";
      }
      case wire::Task::SECAGG_UNMASK:
        if (!secure_) throw secagg::SecAggError("an unmask request without a secure round in progress");
        for (auto& r : secure_->reveal({task.survivors().begin(), task.survivors().end()},
                                       {task.dropped().begin(), task.dropped().end()}))
          *result.add_revealed() = std::move(r);
        secure_.reset();
        return "unmask";
      default: throw secagg::SecAggError("unknown task kind " + std::to_string(task.kind()));
    }
  }

  // Copies the task's weights into `engine`'s model.
  static void load_weights(parallel::StepEngine& engine, const wire::Task& task) {
    std::vector<at::Tensor> params = parameters_of(*engine.parts().model);
    if (static_cast<size_t>(task.weights_size()) != params.size())
      throw ClientError("the server sent " + std::to_string(task.weights_size()) + " tensors for a model of " +
                        std::to_string(params.size()));
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor w = from_wire(task.weights(static_cast<int>(i)));
      if (w.sizes() != params[i].sizes()) throw ClientError("tensor '" + task.weights(static_cast<int>(i)).name() + "' has the wrong shape");
      params[i].copy_(w);
    }
  }

  // Trains on this process's own engine, or on one leased from the pool (Note [A pool of clients]).
  void fit(const wire::Task& task, wire::Result& result) {
    if (!o_.engines) {
      if (task.model_json() != model_json_) {
        model_json_ = task.model_json();
        const model::GptConfig config = model::config_from_json(model_json_);
        engine_ = client_engine(model::Gpt(config, 0));
        sampler_ = std::make_unique<train::Sampler>(*file_, config.context, client_sampler_seed(o_.id));
      }
      return fit_on(*engine_, *sampler_, task, result);
    }
    const train::TokenFile file(token_file_of(o_.data));
    train::Sampler sampler(file, model::config_from_json(task.model_json()).context, client_sampler_seed(o_.id));
    EnginePool::Lease lease(*o_.engines, task.model_json());
    fit_on(lease.engine(), sampler, task, result);
  }

  void fit_on(parallel::StepEngine& engine, train::Sampler& sampler, const wire::Task& task, wire::Result& result) {
    load_weights(engine, task);
    const wire::FitConfig& fit = task.fit();
    const CompressionSpec spec = CompressionSpec::from_wire(fit.compression());
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : parameters_of(*engine.parts().model)) shapes.push_back(p.sizes().vec());
    const std::vector<Structure> structures = round_structures(spec, shapes, fit.seed());
    LocalFit local = fit_locally(engine, sampler, fit, structures);
    // The server's bound, kept here too; under distributed DP, this client's share of the noise.
    if (fit.clip_norm() > 0) clip_update(local.payloads, fit.clip_norm());
    add_gaussian_noise(local.payloads, fit.noise_stddev());
    result.set_examples(static_cast<uint64_t>(sampler.windows()));
    result.set_train_loss(static_cast<float>(local.mean_loss));
    log("round %llu: %u local steps, loss %.4f", static_cast<unsigned long long>(task.round()), fit.local_steps(),
        local.mean_loss);
    if (fit.secagg().enabled()) {
      const auto& s = fit.secagg();
      x_ = secagg::weight_by_examples(
          secagg::quantise_ring(concat_sketched(local.payloads, spec, fit.seed()), s.clip(), static_cast<int>(s.bits()),
                                std::random_device{}()),
          fit.noise_stddev() > 0 ? 1u : static_cast<uint32_t>(sampler.windows()));  // DP-FedAvg: weight 1
      secure_ = std::make_unique<secagg::ClientSession>(o_.id, static_cast<int>(s.threshold()));
      *result.mutable_keys() = secure_->keys();
      return;
    }
    for (auto& e : encode_update(local.payloads, spec, fit.seed(), o_.id, false, rng_)) *result.add_update() = std::move(e);
  }

  const ClientOptions& o_;
  std::unique_ptr<wire::Federation::Stub> stub_;
  std::string session_;
  std::unique_ptr<train::TokenFile> file_;  // pooled: none between tasks
  int64_t tokens_;                          // its training tokens, declared at Join
  std::unique_ptr<train::Sampler> sampler_;
  at::Generator rng_;
  std::string model_json_;
  std::unique_ptr<parallel::StepEngine> engine_;  // the model and its local steps (fit_locally)
  std::unique_ptr<secagg::ClientSession> secure_;
  std::unique_ptr<grpc::ClientContext> presence_context_;
  std::thread presence_;
  std::vector<uint32_t> x_;
  int rounds_done_ = 0;
};

}  // namespace

std::shared_ptr<grpc::Channel> client_channel(const std::string& server, const TlsConfig& tls) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kWireMessageBytes);  // a chunk (Note [Messages in chunks])
  args.SetMaxSendMessageSize(kWireMessageBytes);
  // gRPC backs off up to 120 s between connection attempts by default: a
  // client started before its server, or a server restarting, would be
  // rejoined minutes late. Retry every 0.25-2 s instead.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return grpc::CreateCustomChannel(server, channel_credentials(tls, server), args);
}

uint64_t client_sampler_seed(const std::string& id) { return fnv1a(id); }

int run_client(const ClientOptions& options) {
  if (options.id.empty()) throw ClientError("--id is required");
  if (!options.drop_after.empty() && options.drop_after != "fit" && options.drop_after != "share" &&
      options.drop_after != "mask")
    throw ClientError("--drop-after " + options.drop_after + ": use fit, share or mask");
  if (options.leave_on_signal) {
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
  }
  Participant participant(options);
  return participant.run();
}

}  // namespace meshtrain::fl
