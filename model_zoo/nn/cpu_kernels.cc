// Fused float32 CPU kernels for MindSpore's AOT custom operators (see cpu_kernels.py).
//
// MindSpore's CPU kernels for layer norm, GELU and softmax cross-entropy make several
// passes over memory; these make one per direction, in loops the compiler vectorizes (exp,
// tanh and erf are written out below because the C library's versions are scalar calls).
// `omp simd` marks the reductions that may be vectorized (compiled with -fopenmp-simd,
// which starts no threads). They run on the calling thread: a thread pool of their own
// would compete for the cores with MindSpore's. Every function has MindSpore's AOT
// signature (AOT_ARGS): params holds the inputs, then the outputs; a non-zero return value
// makes MindSpore raise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define AOT_ARGS int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, \
                 void *stream, void *extra
#define AOT_PASS nparam, params, ndims, shapes, dtypes

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

bool all_float32(int count, const char **dtypes) {
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0 && std::strcmp(dtypes[i], "float") != 0) {
      return false;
    }
  }
  return true;
}

int64_t elements(int ndim, const int64_t *shape) {
  int64_t count = 1;
  for (int i = 0; i < ndim; ++i) count *= shape[i];
  return count;
}

int64_t rows_of(int ndim, const int64_t *shape) { return elements(ndim - 1, shape); }

float *as_float(void *pointer) { return static_cast<float *>(pointer); }

// exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, with Cephes' expf polynomial
// (relative error about 1e-7). Arguments below -87 give exp(-87) instead of a denormal.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // NaN stays NaN
  const float n = std::floor(x * 1.4426950409f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return (p * r * r + r + 1.0f) * scale;
}

// tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|): absolute error about 1e-7
inline float tanh_approx(float u) {
  const float e = exp_approx(-2.0f * std::fabs(u));
  const float magnitude = (1.0f - e) / (1.0f + e);
  return u < 0.0f ? -magnitude : magnitude;
}

// erf by Abramowitz and Stegun 7.1.26: absolute error below 1.5e-7
inline float erf_approx(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f +
                     t * (-1.453152027f + t * 1.061405429f))));
  const float magnitude = 1.0f - poly * exp_approx(-a * a);
  return x < 0.0f ? -magnitude : magnitude;
}

}  // namespace

// LayerNorm over the last axis.
// inputs: x (..., H), gamma (H), beta (H), eps (scalar)
// outputs: y (..., H), mean (rows), rstd (rows)
extern "C" int LayerNormForward(AOT_ARGS) {
  if (nparam != 7 || !all_float32(nparam, dtypes)) return 1;
  const float *x = as_float(params[0]), *gamma = as_float(params[1]);
  const float *beta = as_float(params[2]);
  const float eps = *as_float(params[3]);
  float *y = as_float(params[4]), *mean = as_float(params[5]), *rstd = as_float(params[6]);
  const int64_t hidden = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * hidden;
    float *yr = y + r * hidden;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += xr[i];
    const float m = sum / hidden;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += (xr[i] - m) * (xr[i] - m);
    const float s = 1.f / std::sqrt(squares / hidden + eps);
    for (int64_t i = 0; i < hidden; ++i) yr[i] = (xr[i] - m) * s * gamma[i] + beta[i];
    mean[r] = m;
    rstd[r] = s;
  }
  return 0;
}

// inputs: dy, x, gamma, mean, rstd; outputs: dx, dgamma, dbeta
extern "C" int LayerNormBackward(AOT_ARGS) {
  if (nparam != 8 || !all_float32(nparam, dtypes)) return 1;
  const float *dy = as_float(params[0]), *x = as_float(params[1]);
  const float *gamma = as_float(params[2]), *mean = as_float(params[3]);
  const float *rstd = as_float(params[4]);
  float *dx = as_float(params[5]), *dgamma = as_float(params[6]), *dbeta = as_float(params[7]);
  const int64_t hidden = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  std::fill(dgamma, dgamma + hidden, 0.f);
  std::fill(dbeta, dbeta + hidden, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * hidden, *dyr = dy + r * hidden;
    float *dxr = dx + r * hidden;
    const float m = mean[r], s = rstd[r];
    float sum_g = 0.f, sum_g_xhat = 0.f;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
    for (int64_t i = 0; i < hidden; ++i) {
      const float xhat = (xr[i] - m) * s, g = dyr[i] * gamma[i];
      sum_g += g;
      sum_g_xhat += g * xhat;
      dgamma[i] += dyr[i] * xhat;
      dbeta[i] += dyr[i];
    }
    const float mean_g = sum_g / hidden, mean_g_xhat = sum_g_xhat / hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const float xhat = (xr[i] - m) * s;
      dxr[i] = s * (dyr[i] * gamma[i] - mean_g - xhat * mean_g_xhat);
    }
  }
  return 0;
}

// An element-wise function f: y = f(x). inputs: x; outputs: y
template <typename Function>
int elementwise(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                Function f) {
  if (nparam != 2 || !all_float32(nparam, dtypes)) return 1;
  const float *x = as_float(params[0]);
  float *y = as_float(params[1]);
  const int64_t count = elements(ndims[0], shapes[0]);
  for (int64_t i = 0; i < count; ++i) y[i] = f(x[i]);
  return 0;
}

// Its gradient given the derivative f': dx = dy f'(x). inputs: dy, x; outputs: dx
template <typename Derivative>
int elementwise_backward(int nparam, void **params, int *ndims, int64_t **shapes,
                         const char **dtypes, Derivative derivative) {
  if (nparam != 3 || !all_float32(nparam, dtypes)) return 1;
  const float *dy = as_float(params[0]), *x = as_float(params[1]);
  float *dx = as_float(params[2]);
  const int64_t count = elements(ndims[1], shapes[1]);
  for (int64_t i = 0; i < count; ++i) dx[i] = dy[i] * derivative(x[i]);
  return 0;
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
inline float gelu_tanh(float v) {
  return 0.5f * v * (1.f + tanh_approx(kSqrt2OverPi * (v + kGeluCubic * v * v * v)));
}

inline float gelu_tanh_derivative(float v) {
  const float t = tanh_approx(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
  const float du_dx = kSqrt2OverPi * (1.f + 3.f * kGeluCubic * v * v);
  return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du_dx;
}

// GELU with the error function: x Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
inline float gelu_erf(float v) { return 0.5f * v * (1.f + erf_approx(v * kInvSqrt2)); }

// d/dx x Phi(x) = Phi(x) + x phi(x)
inline float gelu_erf_derivative(float v) {
  return 0.5f * (1.f + erf_approx(v * kInvSqrt2)) + v * kInvSqrt2Pi * exp_approx(-0.5f * v * v);
}

extern "C" int GeluTanhForward(AOT_ARGS) { return elementwise(AOT_PASS, gelu_tanh); }
extern "C" int GeluTanhBackward(AOT_ARGS) {
  return elementwise_backward(AOT_PASS, gelu_tanh_derivative);
}
extern "C" int GeluErfForward(AOT_ARGS) { return elementwise(AOT_PASS, gelu_erf); }
extern "C" int GeluErfBackward(AOT_ARGS) {
  return elementwise_backward(AOT_PASS, gelu_erf_derivative);
}

// Softmax cross-entropy against a smoothed one-hot target: `on` at the label, `off`
// elsewhere (on = 1, off = 0 without smoothing). loss = -sum_c t_c log softmax(z)_c.
// inputs: logits (N, V), labels int32 (N), on, off (scalars); outputs: loss (N), lse (N)
extern "C" int CrossEntropyForward(AOT_ARGS) {
  if (nparam != 6 || std::strcmp(dtypes[1], "int32") != 0) return 1;
  const float *logits = as_float(params[0]);
  const int32_t *labels = static_cast<const int32_t *>(params[1]);
  const float on = *as_float(params[2]), off = *as_float(params[3]);
  float *loss = as_float(params[4]), *lse = as_float(params[5]);
  const int64_t rows = shapes[0][0], classes = shapes[0][1];
  int failed = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float *z = logits + r * classes;
    const int32_t label = labels[r];
    if (label < 0 || label >= classes) { failed = 1; continue; }
    float peak = z[0], total = 0.f;
#pragma omp simd reduction(max : peak)
    for (int64_t c = 1; c < classes; ++c) peak = z[c] > peak ? z[c] : peak;
    float exp_sum = 0.f;
#pragma omp simd reduction(+ : exp_sum, total)
    for (int64_t c = 0; c < classes; ++c) {
      exp_sum += exp_approx(z[c] - peak);
      total += z[c];
    }
    const float log_sum_exp = peak + std::log(exp_sum);
    const float target_mass = off * classes + (on - off);
    loss[r] = log_sum_exp * target_mass - off * total - (on - off) * z[label];
    lse[r] = log_sum_exp;
  }
  return failed;
}

// d loss / d z_c = dloss * (softmax_c * sum_c t_c - t_c)
// inputs: dloss (N), logits (N, V), labels (N), lse (N), on, off (scalars); outputs: dlogits
extern "C" int CrossEntropyBackward(AOT_ARGS) {
  if (nparam != 7 || std::strcmp(dtypes[2], "int32") != 0) return 1;
  const float *dloss = as_float(params[0]), *logits = as_float(params[1]);
  const int32_t *labels = static_cast<const int32_t *>(params[2]);
  const float *lse = as_float(params[3]);
  const float on = *as_float(params[4]), off = *as_float(params[5]);
  float *dlogits = as_float(params[6]);
  const int64_t rows = shapes[1][0], classes = shapes[1][1];
  const float target_mass = off * classes + (on - off);
  for (int64_t r = 0; r < rows; ++r) {
    const float *z = logits + r * classes;
    float *dz = dlogits + r * classes;
    const float scale = dloss[r], log_sum_exp = lse[r];
    for (int64_t c = 0; c < classes; ++c) {
      dz[c] = scale * (exp_approx(z[c] - log_sum_exp) * target_mass - off);
    }
    const int32_t label = labels[r];
    if (label >= 0 && label < classes) dz[label] -= scale * (on - off);
  }
  return 0;
}

// The sum of the squares of every element of all inputs (the gradients, for their global
// norm), accumulated in double over blocks. inputs: float32 tensors; outputs: total (1)
extern "C" int SquaredNorm(AOT_ARGS) {
  if (nparam < 2 || !all_float32(nparam, dtypes)) return 1;
  constexpr int64_t kBlock = 4096;
  double total = 0.0;
  for (int t = 0; t < nparam - 1; ++t) {
    const float *values = as_float(params[t]);
    const int64_t count = elements(ndims[t], shapes[t]);
    for (int64_t start = 0; start < count; start += kBlock) {
      const int64_t end = std::min(start + kBlock, count);
      float block = 0.f;
#pragma omp simd reduction(+ : block)
      for (int64_t i = start; i < end; ++i) block += values[i] * values[i];
      total += block;
    }
  }
  *as_float(params[nparam - 1]) = static_cast<float>(total);
  return 0;
}

// y = x + bias over the last axis. inputs: x (..., C), bias (C); outputs: y
extern "C" int BiasAddForward(AOT_ARGS) {
  if (nparam != 3 || !all_float32(nparam, dtypes)) return 1;
  const float *x = as_float(params[0]), *bias = as_float(params[1]);
  float *y = as_float(params[2]);
  const int64_t columns = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * columns;
    float *yr = y + r * columns;
    for (int64_t c = 0; c < columns; ++c) yr[c] = xr[c] + bias[c];
  }
  return 0;
}

// The bias gradient: dy summed over every axis but the last. inputs: dy (..., C); outputs: (C)
extern "C" int ColumnSum(AOT_ARGS) {
  if (nparam != 2 || !all_float32(nparam, dtypes)) return 1;
  const float *dy = as_float(params[0]);
  float *sums = as_float(params[1]);
  const int64_t columns = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  std::fill(sums, sums + columns, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = dy + r * columns;
    for (int64_t c = 0; c < columns; ++c) sums[c] += row[c];
  }
  return 0;
}
