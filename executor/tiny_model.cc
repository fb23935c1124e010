#include "executor/tiny_model.h"

#include <algorithm>
#include <cmath>

namespace pipeplan {
namespace {

// Deterministic value in [-1, 1) from a few integers (SplitMix64 of a mixed key).
double Noise(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ULL ^ (a + 1) * 0xbf58476d1ce4e5b9ULL ^
               (b + 7) * 0x94d049bb133111ebULL ^ (c + 13) * 0xd6e8feb86659fd93ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
}

}  // namespace

TinyModel::TinyModel(const Table& t, TinyDims dims) : d_(dims.width), dims_(dims) {
  for (OpId i = 0; i < t.size(); ++i) {
    const Work& w = t.work(i);
    if (t.kind(i) != OpKind::kF) continue;
    if (t.module(i) == Module::kText) text_layers_ = std::max(text_layers_, w.layer_end);
    if (t.module(i) == Module::kVision) vision_layers_ = std::max(vision_layers_, w.layer_end);
    if (t.module(i) == Module::kGenerator) generator_ = true;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_));
  auto fill = [&](Tensor* v, size_t n, uint64_t module) {
    v->resize(n);
    for (size_t k = 0; k < n; ++k) (*v)[k] = scale * Noise(dims_.seed, module, k, 0);
  };
  const size_t dd = static_cast<size_t>(d_) * d_;
  fill(&p_.text, dd * text_layers_, 1);
  fill(&p_.vision, vision_layers_ > 0 ? dd * (vision_layers_ + 1) : 0, 2);
  fill(&p_.generator, generator_ ? dd : 0, 3);
}

ParamSet TinyModel::ZeroGrads() const {
  ParamSet g;
  g.text.assign(p_.text.size(), 0.0);
  g.vision.assign(p_.vision.size(), 0.0);
  g.generator.assign(p_.generator.size(), 0.0);
  return g;
}

Tensor TinyModel::TextInput(int replica, int mb) const {
  Tensor x(static_cast<size_t>(dims_.tokens) * d_);
  for (size_t k = 0; k < x.size(); ++k) x[k] = Noise(dims_.seed, 10 + replica, mb, k);
  return x;
}

Tensor TinyModel::Target(int replica, int mb) const {
  Tensor y(static_cast<size_t>(dims_.tokens) * d_);
  for (size_t k = 0; k < y.size(); ++k) y[k] = 0.5 * Noise(dims_.seed, 1000 + replica, mb, k);
  return y;
}

Tensor TinyModel::VisionInput(int mb, int task, int shard) const {
  Tensor u(d_);
  for (int k = 0; k < d_; ++k) u[k] = Noise(dims_.seed, 5000 + mb, task * 64 + shard + 1, k);
  return u;
}

const Tensor& TinyModel::W(Module m, int) const {
  return m == Module::kVision ? p_.vision : m == Module::kGenerator ? p_.generator : p_.text;
}

void TinyModel::Forward(Module m, int begin, int end, Tensor* x, std::vector<Tensor>* saved) const {
  const Tensor& all = W(m, 0);
  const size_t rows = x->size() / d_, dd = static_cast<size_t>(d_) * d_;
  for (int l = begin; l < end; ++l) {
    saved->push_back(*x);
    const double* w = all.data() + dd * l;
    const Tensor in = *x;
    for (size_t r = 0; r < rows; ++r)
      for (int i = 0; i < d_; ++i) {
        double z = 0;
        for (int j = 0; j < d_; ++j) z += w[i * d_ + j] * in[r * d_ + j];
        (*x)[r * d_ + i] = in[r * d_ + i] + std::tanh(z);
      }
  }
}

void TinyModel::Backward(Module m, int begin, const std::vector<Tensor>& saved, Tensor* dx,
                         ParamSet* g) const {
  std::vector<Tensor> dz;
  BackwardInput(m, begin, saved, dx, &dz);
  WeightGrad(m, begin, saved, dz, g);
}

void TinyModel::BackwardInput(Module m, int begin, const std::vector<Tensor>& saved, Tensor* dx,
                              std::vector<Tensor>* dz) const {
  const Tensor& all = W(m, 0);
  const size_t rows = dx->size() / d_, dd = static_cast<size_t>(d_) * d_;
  dz->assign(saved.size(), Tensor(dx->size(), 0.0));
  for (int k = static_cast<int>(saved.size()) - 1; k >= 0; --k) {
    const double* w = all.data() + dd * (begin + k);
    const Tensor& in = saved[k];
    const Tensor dout = *dx;
    Tensor& dzk = (*dz)[k];
    for (size_t r = 0; r < rows; ++r)
      for (int i = 0; i < d_; ++i) {
        double z = 0;
        for (int j = 0; j < d_; ++j) z += w[i * d_ + j] * in[r * d_ + j];
        const double t = std::tanh(z), dzi = dout[r * d_ + i] * (1 - t * t);
        dzk[r * d_ + i] = dzi;
        for (int j = 0; j < d_; ++j)
          (*dx)[r * d_ + j] += w[i * d_ + j] * dzi;  // residual path kept: dx starts as dout
      }
  }
}

void TinyModel::WeightGrad(Module m, int begin, const std::vector<Tensor>& saved,
                           const std::vector<Tensor>& dz, ParamSet* g) const {
  Tensor& grads = g->of(m);
  const size_t dd = static_cast<size_t>(d_) * d_;
  for (int k = static_cast<int>(saved.size()) - 1; k >= 0; --k) {
    double* gw = grads.data() + dd * (begin + k);
    const Tensor &in = saved[k], &dzk = dz[k];
    const size_t rows = in.size() / d_;
    for (size_t r = 0; r < rows; ++r)
      for (int i = 0; i < d_; ++i)
        for (int j = 0; j < d_; ++j) gw[i * d_ + j] += dzk[r * d_ + i] * in[r * d_ + j];
  }
}

Tensor TinyModel::Project(const Tensor& u) const {
  const double* p = p_.vision.data() + static_cast<size_t>(d_) * d_ * vision_layers_;
  Tensor v(d_, 0.0);
  for (int i = 0; i < d_; ++i)
    for (int j = 0; j < d_; ++j) v[i] += p[i * d_ + j] * u[j];
  return v;
}

Tensor TinyModel::ProjectBack(const Tensor& u, const Tensor& dv, ParamSet* g) const {
  const size_t off = static_cast<size_t>(d_) * d_ * vision_layers_;
  const double* p = p_.vision.data() + off;
  Tensor du(d_, 0.0);
  for (int i = 0; i < d_; ++i)
    for (int j = 0; j < d_; ++j) {
      g->vision[off + i * d_ + j] += dv[i] * u[j];
      du[j] += p[i * d_ + j] * dv[i];
    }
  return du;
}

double TinyModel::Head(const Tensor& x, const Tensor& target, Tensor* dx, ParamSet* g) const {
  dx->assign(x.size(), 0.0);
  double loss = 0;
  if (!generator_) {
    for (size_t k = 0; k < x.size(); ++k) {
      const double e = x[k] - target[k];
      loss += 0.5 * e * e, (*dx)[k] = e;
    }
    return loss;
  }
  const double* G = p_.generator.data();
  const size_t rows = x.size() / d_;
  for (size_t r = 0; r < rows; ++r)
    for (int i = 0; i < d_; ++i) {
      double z = 0;
      for (int j = 0; j < d_; ++j) z += G[i * d_ + j] * x[r * d_ + j];
      const double y = std::tanh(z), e = y - target[r * d_ + i], dz = e * (1 - y * y);
      loss += 0.5 * e * e;
      for (int j = 0; j < d_; ++j) {
        g->generator[i * d_ + j] += dz * x[r * d_ + j];
        (*dx)[r * d_ + j] += G[i * d_ + j] * dz;
      }
    }
  return loss;
}

}  // namespace pipeplan
