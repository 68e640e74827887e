#include "meshtrain/parallel/tensor_parallel_ops.h"

#include "meshtrain/model/batch.h"
#include "meshtrain/parallel/saved_comm.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

namespace meshtrain::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A gather in flight: every rank's chunk stacked in `stacked` [t, ...chunk].
struct PendingGather {
  comm::Work work;
  at::Tensor stacked;
  int64_t dim;

  // Waits, then lays the chunks side by side along `dim`.
  at::Tensor finish() {
    work.wait();
    std::vector<int64_t> shape = stacked.sizes().slice(1).vec();
    shape[dim] *= stacked.size(0);
    return stacked.movedim(0, dim).reshape(shape);
  }
};

PendingGather start_gather(const at::Tensor& x, comm::Communicator& comm, int64_t dim) {
  const at::Tensor chunk = x.contiguous();
  std::vector<int64_t> shape = chunk.sizes().vec();
  shape.insert(shape.begin(), comm.size());
  at::Tensor stacked = at::empty(shape, chunk.options());
  comm::Work work = comm.all_gather(stacked.view(-1), chunk.view(-1));
  return {std::move(work), stacked, dim};
}

struct PendingScatter {
  comm::Work work;
  at::Tensor output, input;  // input kept alive until the work is done

  at::Tensor finish() {
    work.wait();
    input = at::Tensor();
    return output;
  }
};

PendingScatter start_reduce_scatter(const at::Tensor& x, comm::Communicator& comm, int64_t dim) {
  const int64_t t = comm.size();
  TORCH_CHECK(x.size(dim) % t == 0, "reduce-scatter along dim ", dim, ": size ", x.size(dim),
              " does not divide into ", t, " chunks");
  std::vector<int64_t> split = x.sizes().vec();
  split[dim] /= t;
  std::vector<int64_t> local = split;
  split.insert(split.begin() + dim, t);
  // [..., t, c, ...] with the rank axis moved first: chunk r is block r.
  at::Tensor input = x.reshape(split).movedim(dim, 0).contiguous();
  at::Tensor output = at::empty(local, x.options());
  comm::Work work = comm.reduce_scatter(output.view(-1), input.view(-1));
  return {std::move(work), output, input};
}

at::Tensor chunk_of(const at::Tensor& x, const comm::Communicator& comm, int64_t dim) {
  TORCH_CHECK(x.size(dim) % comm.size() == 0, "sequence chunk along dim ", dim, ": size ", x.size(dim),
              " does not divide into ", comm.size(), " chunks");
  const int64_t c = x.size(dim) / comm.size();
  return x.narrow(dim, comm.rank() * c, c).contiguous();
}

at::Tensor all_reduced(const at::Tensor& x, comm::Communicator& comm) {
  at::Tensor out = x.contiguous().clone();
  comm.all_reduce(out).wait();
  return out;
}

struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& comm) {
    save_comm(ctx, comm);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduced(grads[0], *saved_comm(ctx)), at::Tensor()};
  }
};

struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const CommPtr& comm) { return all_reduced(x, *comm); }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& comm, int64_t dim) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return chunk_of(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {all_gather_along(grads[0], *saved_comm(ctx), dim), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& comm, int64_t dim) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return all_gather_along(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {reduce_scatter_along(grads[0], *saved_comm(ctx), dim), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& comm, int64_t dim) {
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    return reduce_scatter_along(x, *comm, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {all_gather_along(grads[0], *saved_comm(ctx), dim), at::Tensor(), at::Tensor()};
  }
};

// The dtype at::linear would compute in here: autocast's, else the weight's.
at::ScalarType compute_dtype(const at::Tensor& weight) {
  const c10::DeviceType device = weight.device().type();
  return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : weight.scalar_type();
}

struct SequenceGatheredLinear : torch::autograd::Function<SequenceGatheredLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const CommPtr& comm, int64_t dim) {
    const at::ScalarType dtype = compute_dtype(weight);
    save_comm(ctx, comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["dtype"] = static_cast<int64_t>(dtype);
    const bool has_bias = bias.numel() > 0;  // see sequence_gathered_linear
    ctx->saved_data["bias"] = has_bias;
    ctx->save_for_backward({x, weight});
    const at::Tensor full = start_gather(x.to(dtype), *comm, dim).finish();
    return at::linear(full, weight.to(dtype), has_bias ? bias.to(dtype) : at::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const CommPtr comm = saved_comm(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor grad = grads[0].to(dtype);
    // A frozen weight (LoRA's base) needs neither the gathered input nor its gradient.
    const bool weight_grad = ctx->needs_input_grad(1);
    PendingGather gather;
    if (weight_grad) gather = start_gather(x.to(dtype), *comm, dim);
    const at::Tensor grad_full_input = at::matmul(grad, weight.to(dtype));
    PendingScatter scatter = start_reduce_scatter(grad_full_input, *comm, dim);
    const at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    at::Tensor grad_weight, grad_bias;
    if (weight_grad) {
      const at::Tensor full = gather.finish();
      grad_weight = grad_2d.t().mm(full.reshape({-1, full.size(-1)})).to(weight.scalar_type());
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = grad_2d.sum(0).to(weight.scalar_type());
    return {scatter.finish().to(x.scalar_type()), grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, const CommPtr& comm, double z_loss) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "vocab-parallel cross-entropy takes fp32 [N, V/t]");
    const int64_t n = logits.size(0), local = logits.size(1);
    at::Tensor max = std::get<0>(logits.max(-1)).contiguous();
    comm->all_reduce(max, comm::ReduceOp::kMax).wait();
    at::Tensor exp = (logits - max.unsqueeze(1)).exp_();
    const at::Tensor mine = (targets >= vocab_start) & (targets < vocab_start + local);
    const at::Tensor index = (targets - vocab_start).clamp(0, local - 1);
    // [sum of exp, shifted target logit] of every row, summed over the ranks.
    at::Tensor sums = at::empty({2, n}, logits.options());
    sums[0] = exp.sum(-1);
    sums[1] = (logits.gather(1, index.unsqueeze(1)).squeeze(1) - max) * mine;
    comm->all_reduce(sums).wait();
    // Ignored targets count toward no loss (the mean is over those that count; 0 when none does).
    const at::Tensor counted = targets != model::kIgnoredTarget;
    const at::Tensor count = counted.sum().clamp_min(1).to(at::kFloat);
    at::Tensor loss = ((sums[0].log() - sums[1]) * counted).sum() / count;
    exp.div_(sums[0].unsqueeze(1));  // now the softmax
    if (z_loss > 0) {  // β·lse² per counted row; its gradient scales the row's softmax by 1 + 2β·lse
      const at::Tensor lse = sums[0].log() + max;
      loss = loss + (lse.square() * counted).sum() * z_loss / count;
      exp.mul_((lse * (2 * z_loss) + 1).unsqueeze(1));
    }
    ctx->save_for_backward({exp, index, mine, counted, count});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &softmax = saved[0], &index = saved[1], &mine = saved[2], &counted = saved[3], &count = saved[4];
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, index.unsqueeze(1), -mine.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(counted.to(grad.scalar_type()).unsqueeze(1) * (grads[0] / count));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_gather_along(const at::Tensor& x, comm::Communicator& comm, int64_t dim) {
  return start_gather(x, comm, dim).finish();
}

at::Tensor reduce_scatter_along(const at::Tensor& x, comm::Communicator& comm, int64_t dim) {
  return start_reduce_scatter(x, comm, dim).finish();
}

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const CommPtr& comm) {
  return CopyToTensorParallel::apply(x, comm);
}

at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const CommPtr& comm) {
  return ReduceFromTensorParallel::apply(x, comm);
}

at::Tensor scatter_to_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim) {
  return ScatterToSequence::apply(x, comm, dim);
}

at::Tensor gather_from_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim) {
  return GatherFromSequence::apply(x, comm, dim);
}

at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim) {
  return ReduceScatterToSequence::apply(x, comm, dim);
}

at::Tensor sequence_gathered_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                    const CommPtr& comm, int64_t dim) {
  // Autograd functions take defined tensors only: no bias is an empty one.
  return SequenceGatheredLinear::apply(x, weight, bias.defined() ? bias : at::empty({0}, weight.options()), comm, dim);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                        const CommPtr& comm, double z_loss) {
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_start, comm, z_loss);
}

model::VocabShard vocab_shard(int64_t start, const CommPtr& comm) {
  model::VocabShard shard;
  shard.start = start;
  shard.max = [comm](at::Tensor& x) { comm->all_reduce(x, comm::ReduceOp::kMax).wait(); };
  shard.sum = [comm](at::Tensor& x) { comm->all_reduce(x).wait(); };
  return shard;
}

}  // namespace meshtrain::parallel
