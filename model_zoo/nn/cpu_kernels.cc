// Fused float32 CPU kernels for MindSpore's AOT custom operators (see cpu_kernels.py).
//
// MindSpore's CPU kernels for layer norm, GELU and softmax cross-entropy make several
// passes over memory; these make one per direction, in loops the compiler vectorizes (exp
// and erf are written out below because the C library's versions are scalar calls).
// `omp simd` marks the reductions that may be vectorized (compiled with -fopenmp-simd,
// which starts no threads). Each kernel splits its rows or elements over the calling
// thread and helper threads of its own (`parallel_for`), which spin briefly between kernels
// and then sleep (MindSpore runs most kernels one after another, so its threads are mostly
// waiting while these run). The dense layers and attention call the oneDNN that MindSpore
// ships, on the same helpers. Every function has MindSpore's AOT signature (AOT_ARGS):
// params holds the inputs, then the outputs; a non-zero return value makes MindSpore raise.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define AOT_ARGS int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, \
                 void *stream, void *extra
#define AOT_PASS nparam, params, ndims, shapes, dtypes
#define AOT_PASS_ALL AOT_PASS, stream, extra

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kMaskValue = -1e9f;   // the score of a masked position (layers.MASK_VALUE)

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
// (relative error about 1e-7). Arguments below -75 give 0: a softmax term that small is far
// below float32's precision, and the products made of it (times 1 / the row's sum, then in
// the next matmul) would turn denormal, which x86 computes at a fraction of its speed where
// the thread does not flush them (the masked scores of causal attention: 3-5x slower).
inline float exp_approx(float x) {
  if (x < -75.0f) return 0.0f;
  x = x > 88.0f ? 88.0f : x;  // NaN stays NaN
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

// The cores this process's kernels use, at most 8: those it may run on (its affinity mask),
// or fewer when MODEL_ZOO_CPU_THREADS says so (the launcher's share of the machine for each
// of several ranks on it, so that their helpers do not outnumber the cores)
int usable_cores() {
  cpu_set_t set;
  int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  if (const char *share = std::getenv("MODEL_ZOO_CPU_THREADS")) {
    const int threads = std::atoi(share);
    if (threads >= 1) cores = std::min(cores, threads);
  }
  return std::max(1, std::min(8, cores));
}

// Threads kept for the life of the process, so that a call costs a wake-up rather than a
// thread start (a decoding step makes about 50 of these calls). `run(job, shares)` runs
// job(0..shares-1) on the calling thread and the helpers and returns when all have ended.
// Shares are claimed, not assigned: each thread takes the next unclaimed one until none is
// left, so a helper that is late (asleep, or its core taken by another process of a shared
// host) leaves its share to whoever is running instead of holding the step up.
class Helpers {
 public:
  explicit Helpers(int count) : count_(count) {
    for (int i = 1; i <= count; ++i) std::thread([this] { serve(); }).detach();
  }

  int count() const { return count_; }

  void run(const std::function<void(int)> &job, int shares) {
    // one job at a time: MindSpore may launch two kernels at once from its own threads
    std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
    int64_t generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      shares_ = shares;
      done_.store(0);
      generation = (claims_.load() >> 32) + 1;
      claims_.store(generation << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work(generation, job, shares);
    // the shares still running are on helpers: wait for them awake, yielding the core if
    // one of them has to be scheduled on it
    for (int64_t round = 0; done_.load(std::memory_order_acquire) != shares; ++round) {
      if (round % 64 == 63) std::this_thread::yield();
      pause();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Claims and runs shares of the job of `generation` until none is left. claims_ holds
  // the generation (high 32 bits) and the next share (low 32 bits) in one word, so a helper
  // still holding an earlier job can never claim a share of a later one.
  void work(int64_t generation, const std::function<void(int)> &job, int shares) {
    for (;;) {
      int64_t word = claims_.load(std::memory_order_acquire);
      do {
        if ((word >> 32) != generation || (word & 0xffffffff) >= shares) return;
      } while (!claims_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel));
      job(static_cast<int>(word & 0xffffffff));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void serve() {
    int64_t seen = 0;
    for (;;) {
      // Spin for a while before sleeping: the kernels of a training step come back to back,
      // and waking a sleeping thread costs tens of microseconds
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
      for (int spin = 0; (claims_.load(std::memory_order_acquire) >> 32) == seen; ++spin) {
        pause();
        if (spin % 256 == 255 && std::chrono::steady_clock::now() > until) break;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return (claims_.load() >> 32) != seen; });
      seen = claims_.load() >> 32;
      const std::function<void(int)> *job = job_;
      const int shares = shares_;
      lock.unlock();
      work(seen, *job, shares);
    }
  }

  static constexpr int kSpinUs = 200;
  const int count_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_;
  const std::function<void(int)> *job_ = nullptr;
  int shares_ = 0;
  std::atomic<int> done_{0};
  std::atomic<int64_t> claims_{0};
};

Helpers &helpers() {
  static Helpers *pool = new Helpers(usable_cores() - 1);   // never destroyed: detached
  return *pool;
}

// The threads a kernel runs on: the calling one and the helpers (read by the tests)
extern "C" int KernelThreads() { return helpers().count() + 1; }

// How many parts parallel_for cuts `count` items into: one per core, each of at least
// `grain` items (below that, handing a part out costs more than it saves)
int parts_for(int64_t count, int64_t grain) {
  return static_cast<int>(std::min<int64_t>(
      helpers().count() + 1, std::max<int64_t>(1, count / std::max<int64_t>(1, grain))));
}

// body(begin, end, part) over [0, count) in parts_for(count, grain) equal parts, on the
// calling thread and the helpers. The kernels' bodies capture by value: pointers captured
// by reference would be reloaded after every store, and their loops would not vectorize.
void parallel_for(int64_t count, int64_t grain,
                  const std::function<void(int64_t, int64_t, int)> &body) {
  const int parts = parts_for(count, grain);
  if (parts == 1) {
    body(0, count, 0);
    return;
  }
  helpers().run(
      [&](int part) { body(count * part / parts, count * (part + 1) / parts, part); }, parts);
}

// Rows per part of a row-wise kernel: about 32k floats, or one row
int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, width));
}

// An opt-in clock for profiles (benchmarks/decode_profile.py): with MODEL_ZOO_KERNEL_CLOCK
// set when the library loads, each kernel that declares a `Clocked` adds its wall time and
// one call under its name; KernelClockRead lists them, KernelClockReset clears them. Off, a
// kernel pays one branch.
class KernelClock {
 public:
  static KernelClock &get() {
    static KernelClock *clock = new KernelClock(std::getenv("MODEL_ZOO_KERNEL_CLOCK") != nullptr);
    return *clock;
  }
  bool on() const { return on_; }
  void add(const char *name, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Entry &entry : entries_) {
      if (entry.name == name) {
        entry.seconds += seconds;
        ++entry.calls;
        return;
      }
    }
    entries_.push_back({name, seconds, 1});
  }
  int read(char *text, int size) {   // "name seconds calls" lines; the length it needs
    std::lock_guard<std::mutex> lock(mutex_);
    std::string all;
    for (const Entry &entry : entries_) {
      all += std::string(entry.name) + " " + std::to_string(entry.seconds) + " " +
             std::to_string(entry.calls) + "\n";
    }
    if (size > 0) {
      const size_t copied = std::min<size_t>(all.size(), size - 1);
      std::memcpy(text, all.data(), copied);
      text[copied] = '\0';
    }
    return static_cast<int>(all.size()) + 1;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
  }

 private:
  struct Entry {
    const char *name;
    double seconds;
    int64_t calls;
  };
  explicit KernelClock(bool on) : on_(on) {}
  const bool on_;
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

// Times the scope it is declared in, when the clock is on
class Clocked {
 public:
  explicit Clocked(const char *name) : name_(KernelClock::get().on() ? name : nullptr) {
    if (name_) started_ = std::chrono::steady_clock::now();
  }
  ~Clocked() {
    if (name_) {
      KernelClock::get().add(name_, std::chrono::duration<double>(
                                        std::chrono::steady_clock::now() - started_).count());
    }
  }

 private:
  const char *name_;
  std::chrono::steady_clock::time_point started_;
};

extern "C" int KernelClockRead(char *text, int size) { return KernelClock::get().read(text, size); }
extern "C" void KernelClockReset() { KernelClock::get().reset(); }

// Dropout whose mask is a function of a key and the element's index alone (SplitMix64 of
// both): the same key gives the same mask on any machine, in any run, and the backward pass
// regenerates it instead of storing it.
inline uint64_t splitmix64(uint64_t value) {
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ull;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBull;
  return value ^ (value >> 31);
}

struct KeyedMask {
  KeyedMask(const int32_t *key, float keep)
      : drops(keep < 1.f),
        threshold(static_cast<uint64_t>(static_cast<double>(keep) * (1 << 24))),
        scale(1.0f / keep) {
    for (int i = 0; i < 4; ++i) base = splitmix64(base + static_cast<uint32_t>(key[i]));
  }
  // an element is kept when the top 24 bits of its draw, as a fraction, are below `keep`
  static bool keeps(uint64_t base, uint64_t threshold, int64_t index) {
    return (splitmix64(base + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index)) >> 40) <
           threshold;
  }
  // y = x * mask / keep over elements first .. first + count - 1 of the masked tensor (y
  // may be x). The fields are read into locals first: stores through y could otherwise
  // alias them, and the loop would not vectorize.
  void apply(const float *x, float *y, int64_t first, int64_t count) const {
    const uint64_t b = base, t = threshold;
    const float s = scale;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) y[i] = keeps(b, t, first + i) ? x[i] * s : 0.0f;
  }
  uint64_t base = 0;
  const bool drops;   // keep < 1: apply changes something
  const uint64_t threshold;
  const float scale;   // 1 / keep, for the elements kept
};

// One row's layer norm: y = (x - mean) rstd gamma + beta over `hidden` features
inline void layer_norm_row(const float *x, const float *gamma, const float *beta, float eps,
                           int64_t hidden, float *y, float *mean, float *rstd) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) sum += x[i];
  const float m = sum / hidden;
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += (x[i] - m) * (x[i] - m);
  const float s = 1.f / std::sqrt(squares / hidden + eps);
  for (int64_t i = 0; i < hidden; ++i) y[i] = (x[i] - m) * s * gamma[i] + beta[i];
  *mean = m;
  *rstd = s;
}

// One row's RMSNorm: y = x rstd weight, rstd = 1 / sqrt(mean(x^2) + eps); returns rstd
inline float rms_norm_row(const float *x, const float *weight, float eps, int64_t hidden,
                          float *y) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += x[i] * x[i];
  const float s = 1.f / std::sqrt(squares / hidden + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) y[i] = x[i] * s * weight[i];
  return s;
}

// LayerNorm over the last axis.
// inputs: x (..., H), gamma (H), beta (H), eps (scalar)
// outputs: y (..., H), mean (rows), rstd (rows)
extern "C" int LayerNormForward(AOT_ARGS) {
  Clocked clocked("LayerNormForward");
  if (nparam != 7 || !all_float32(nparam, dtypes)) return 1;
  const float *x = as_float(params[0]), *gamma = as_float(params[1]);
  const float *beta = as_float(params[2]);
  const float eps = *as_float(params[3]);
  float *y = as_float(params[4]), *mean = as_float(params[5]), *rstd = as_float(params[6]);
  const int64_t hidden = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  parallel_for(rows, row_grain(hidden), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      layer_norm_row(x + r * hidden, gamma, beta, eps, hidden, y + r * hidden, mean + r,
                     rstd + r);
    }
  });
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
  // each part sums the parameter gradients of its rows apart; the parts are added in order
  const int64_t grain = row_grain(hidden);
  std::vector<float> sums(2 * hidden * parts_for(rows, grain), 0.f);
  float *partials = sums.data();
  parallel_for(rows, grain, [=](int64_t begin, int64_t end, int part) {
    float *part_dgamma = partials + 2 * hidden * part, *part_dbeta = part_dgamma + hidden;
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * hidden, *dyr = dy + r * hidden;
      float *dxr = dx + r * hidden;
      const float m = mean[r], s = rstd[r];
      float sum_g = 0.f, sum_g_xhat = 0.f;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
      for (int64_t i = 0; i < hidden; ++i) {
        const float xhat = (xr[i] - m) * s, g = dyr[i] * gamma[i];
        sum_g += g;
        sum_g_xhat += g * xhat;
        part_dgamma[i] += dyr[i] * xhat;
        part_dbeta[i] += dyr[i];
      }
      const float mean_g = sum_g / hidden, mean_g_xhat = sum_g_xhat / hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float xhat = (xr[i] - m) * s;
        dxr[i] = s * (dyr[i] * gamma[i] - mean_g - xhat * mean_g_xhat);
      }
    }
  });
  std::fill(dgamma, dgamma + hidden, 0.f);
  std::fill(dbeta, dbeta + hidden, 0.f);
  for (size_t offset = 0; offset < sums.size(); offset += 2 * hidden) {
    for (int64_t i = 0; i < hidden; ++i) {
      dgamma[i] += sums[offset + i];
      dbeta[i] += sums[offset + hidden + i];
    }
  }
  return 0;
}

// RMSNorm over the last axis (`rms_norm_row`).
// inputs: x (..., H), weight (H), eps (scalar); outputs: y (..., H), rstd (rows)
extern "C" int RmsNormForward(AOT_ARGS) {
  Clocked clocked("RmsNormForward");
  if (nparam != 5 || !all_float32(nparam, dtypes)) return 1;
  const float *x = as_float(params[0]), *weight = as_float(params[1]);
  const float eps = *as_float(params[2]);
  float *y = as_float(params[3]), *rstd = as_float(params[4]);
  const int64_t hidden = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  parallel_for(rows, row_grain(hidden), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      rstd[r] = rms_norm_row(x + r * hidden, weight, eps, hidden, y + r * hidden);
    }
  });
  return 0;
}

// inputs: dy, x, weight, rstd; outputs: dx, dweight
// xhat = x rstd, g = dy weight: dx = rstd (g - xhat mean(g xhat)), dweight = sum(dy xhat)
extern "C" int RmsNormBackward(AOT_ARGS) {
  if (nparam != 6 || !all_float32(nparam, dtypes)) return 1;
  const float *dy = as_float(params[0]), *x = as_float(params[1]);
  const float *weight = as_float(params[2]), *rstd = as_float(params[3]);
  float *dx = as_float(params[4]), *dweight = as_float(params[5]);
  const int64_t hidden = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  // each part sums the weight gradient of its rows apart; the parts are added in order
  const int64_t grain = row_grain(hidden);
  std::vector<float> sums(hidden * parts_for(rows, grain), 0.f);
  float *partials = sums.data();
  parallel_for(rows, grain, [=](int64_t begin, int64_t end, int part) {
    float *part_dweight = partials + hidden * part;
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * hidden, *dyr = dy + r * hidden;
      float *dxr = dx + r * hidden;
      const float s = rstd[r];
      float sum_g_xhat = 0.f;
#pragma omp simd reduction(+ : sum_g_xhat)
      for (int64_t i = 0; i < hidden; ++i) {
        const float xhat = xr[i] * s;
        sum_g_xhat += dyr[i] * weight[i] * xhat;
        part_dweight[i] += dyr[i] * xhat;
      }
      const float mean_g_xhat = sum_g_xhat / hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i)
        dxr[i] = s * (dyr[i] * weight[i] - xr[i] * s * mean_g_xhat);
    }
  });
  std::fill(dweight, dweight + hidden, 0.f);
  for (size_t offset = 0; offset < sums.size(); offset += hidden)
    for (int64_t i = 0; i < hidden; ++i) dweight[i] += sums[offset + i];
  return 0;
}

// Rotary position embedding, Hugging Face's half-split layout: for each row of x
// (..., seq, W) at position p = row % seq, each head's first D features (D: the tables'
// width) rotate as y = x cos[p] + [-x2, x1] sin[p]. A row holds W / (parts D) heads of
// `parts` x D features each: the query heads alone (parts 1: x (B, H, L, D) or (B, L, H D))
// or the fused key-value projection (parts 2: (B, L, Hkv 2 D), each key rotated and the
// value after it copied).
// inputs: x (..., seq, W), cos (seq, D), sin (seq, D); outputs: y
// With `transposed` the rotation is undone (the backward pass: dx = dy cos + [dy2, -dy1] sin
// read with the same tables, since the rotation's transpose is its inverse's form).
static int rotary(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                  int64_t parts, bool transposed) {
  if (nparam != 4 || !all_float32(nparam, dtypes) || ndims[1] != 2) return 1;
  const float *x = as_float(params[0]), *cosine = as_float(params[1]);
  const float *sine = as_float(params[2]);
  float *y = as_float(params[3]);
  const int64_t width = shapes[0][ndims[0] - 1], seq = shapes[0][ndims[0] - 2];
  const int64_t d = shapes[1][1], head = parts * d, half = d / 2;
  if (d % 2 || width % head || shapes[1][0] < seq) return 1;
  const int64_t rows = rows_of(ndims[0], shapes[0]);
  const float sign = transposed ? -1.f : 1.f;
  parallel_for(rows, row_grain(width), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *c = cosine + (r % seq) * d, *s = sine + (r % seq) * d;
      for (int64_t first = r * width; first < (r + 1) * width; first += head) {
        const float *xr = x + first;
        float *yr = y + first;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          yr[i] = xr[i] * c[i] - sign * xr[i + half] * s[transposed ? i + half : i];
          yr[i + half] = xr[i + half] * c[i + half] + sign * xr[i] * s[transposed ? i : i + half];
        }
        std::copy(xr + d, xr + head, yr + d);
      }
    }
  });
  return 0;
}

extern "C" int RotaryForward(AOT_ARGS) {
  return rotary(nparam, params, ndims, shapes, dtypes, 1, false);
}

extern "C" int RotaryBackward(AOT_ARGS) {
  return rotary(nparam, params, ndims, shapes, dtypes, 1, true);
}

extern "C" int RotaryKeysForward(AOT_ARGS) {
  return rotary(nparam, params, ndims, shapes, dtypes, 2, false);
}

extern "C" int RotaryKeysBackward(AOT_ARGS) {
  return rotary(nparam, params, ndims, shapes, dtypes, 2, true);
}

// SwiGLU over interleaved pairs: for y = [g_0, u_0, g_1, u_1, ...] (..., 2F),
// h = silu(g) u (..., F), silu(g) = g sigmoid(g). inputs: y; outputs: h
inline float sigmoid_approx(float g) {
  const float minus_g = -g;
  return 1.f / (1.f + exp_approx(minus_g < 80.f ? minus_g : 80.f));
}

extern "C" int SwigluForward(AOT_ARGS) {
  if (nparam != 2 || !all_float32(nparam, dtypes)) return 1;
  const float *y = as_float(params[0]);
  float *h = as_float(params[1]);
  const int64_t width = shapes[1][ndims[1] - 1], rows = rows_of(ndims[1], shapes[1]);
  parallel_for(rows, row_grain(width), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *yr = y + 2 * r * width;
      float *hr = h + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = yr[2 * i], u = yr[2 * i + 1];
        hr[i] = g * sigmoid_approx(g) * u;
      }
    }
  });
  return 0;
}

// inputs: dh (..., F), y (..., 2F); outputs: dy (..., 2F), interleaved like y:
// dg = dh u silu'(g), silu'(g) = s (1 + g (1 - s)); du = dh silu(g)
extern "C" int SwigluBackward(AOT_ARGS) {
  if (nparam != 3 || !all_float32(nparam, dtypes)) return 1;
  const float *dh = as_float(params[0]), *y = as_float(params[1]);
  float *dy = as_float(params[2]);
  const int64_t width = shapes[0][ndims[0] - 1], rows = rows_of(ndims[0], shapes[0]);
  parallel_for(rows, row_grain(width), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *yr = y + 2 * r * width, *dhr = dh + r * width;
      float *dyr = dy + 2 * r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = yr[2 * i], u = yr[2 * i + 1], s = sigmoid_approx(g);
        dyr[2 * i] = dhr[i] * u * s * (1.f + g * (1.f - s));
        dyr[2 * i + 1] = dhr[i] * g * s;
      }
    }
  });
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
  parallel_for(count, 1 << 15, [=](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) y[i] = f(x[i]);
  });
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
  parallel_for(count, 1 << 15, [=](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) dx[i] = dy[i] * derivative(x[i]);
  });
  return 0;
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed
// as x sigmoid(2u) = x / (1 + exp(-2u)), one exp and one division (25% faster than through
// tanh). exp's argument stops at 80, where sigmoid is negligible (1.8e-35) and still
// normal.
inline float sigmoid_of_2u(float v) {
  const float minus_2u = -2.f * kSqrt2OverPi * (v + kGeluCubic * v * v * v);
  return 1.f / (1.f + exp_approx(minus_2u < 80.f ? minus_2u : 80.f));
}

inline float gelu_tanh(float v) { return v * sigmoid_of_2u(v); }

// d/dx x s(2u) = s + x s (1 - s) 2 du/dx
inline float gelu_tanh_derivative(float v) {
  const float s = sigmoid_of_2u(v);
  const float d2u_dx = 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * v * v);
  return s + v * s * (1.f - s) * d2u_dx;
}

// GELU with the error function: x Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
inline float gelu_erf(float v) { return 0.5f * v * (1.f + erf_approx(v * kInvSqrt2)); }

// d/dx x Phi(x) = Phi(x) + x phi(x)
inline float gelu_erf_derivative(float v) {
  return 0.5f * (1.f + erf_approx(v * kInvSqrt2)) + v * kInvSqrt2Pi * exp_approx(-0.5f * v * v);
}

// (functions passed as lambdas, whose type names them, so that they are inlined into the
// loops; a function pointer captured by the loop's closure would be called per element)
extern "C" int GeluTanhForward(AOT_ARGS) {
  return elementwise(AOT_PASS, [](float v) { return gelu_tanh(v); });
}
extern "C" int GeluTanhBackward(AOT_ARGS) {
  return elementwise_backward(AOT_PASS, [](float v) { return gelu_tanh_derivative(v); });
}
extern "C" int GeluErfForward(AOT_ARGS) {
  return elementwise(AOT_PASS, [](float v) { return gelu_erf(v); });
}
extern "C" int GeluErfBackward(AOT_ARGS) {
  return elementwise_backward(AOT_PASS, [](float v) { return gelu_erf_derivative(v); });
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
  std::atomic<int> failed{0};
  std::atomic<int> *any_failed = &failed;
  parallel_for(rows, row_grain(classes), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *z = logits + r * classes;
      const int32_t label = labels[r];
      if (label < 0 || label >= classes) {
        any_failed->store(1);
        continue;
      }
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
  });
  return failed.load();
}

// The k most likely tokens of every row and their log-probabilities (a search step), in one
// pass for the log-sum-exp and one for the k best (kept sorted by insertion; an equal
// logit keeps the lower id first). inputs: logits (N, V); outputs: values (N, k), ids (N, k)
extern "C" int LogSoftmaxTopK(AOT_ARGS) {
  Clocked clocked("LogSoftmaxTopK");
  if (nparam != 3 || std::strcmp(dtypes[2], "int32") != 0) return 1;
  const float *logits = as_float(params[0]);
  float *values = as_float(params[1]);
  int32_t *ids = static_cast<int32_t *>(params[2]);
  const int64_t rows = shapes[0][0], classes = shapes[0][1], k = shapes[1][1];
  if (k < 1 || k > classes) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    const float *z = logits + r * classes;
    float *best = values + r * k;
    int32_t *best_ids = ids + r * k;
    float peak = z[0];
#pragma omp simd reduction(max : peak)
    for (int64_t c = 1; c < classes; ++c) peak = z[c] > peak ? z[c] : peak;
    float exp_sum = 0.f;
#pragma omp simd reduction(+ : exp_sum)
    for (int64_t c = 0; c < classes; ++c) exp_sum += exp_approx(z[c] - peak);
    const float log_sum_exp = peak + std::log(exp_sum);
    int64_t kept = 0;
    for (int64_t c = 0; c < classes; ++c) {
      if (kept == k && !(z[c] > best[k - 1])) continue;
      int64_t at = kept < k ? kept++ : k - 1;
      while (at > 0 && z[c] > best[at - 1]) {
        best[at] = best[at - 1];
        best_ids[at] = best_ids[at - 1];
        --at;
      }
      best[at] = z[c];
      best_ids[at] = static_cast<int32_t>(c);
    }
    for (int64_t i = 0; i < k; ++i) best[i] -= log_sum_exp;
  }
  return 0;
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
  parallel_for(rows, row_grain(classes), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *z = logits + r * classes;
      float *dz = dlogits + r * classes;
      const float scale = dloss[r], log_sum_exp = lse[r];
      for (int64_t c = 0; c < classes; ++c) {
        dz[c] = scale * (exp_approx(z[c] - log_sum_exp) * target_mass - off);
      }
      const int32_t label = labels[r];
      if (label >= 0 && label < classes) dz[label] -= scale * (on - off);
    }
  });
  return 0;
}

// Few-rows matmul (decoding): y = x w^T for x (M, K) with M small and w (N, K). Each group
// of rows of w is read from memory once and dotted with every row of x (which stays in
// L1), so the time is one pass over w at the memory bandwidth, split over the cores;
// MindSpore's MatMul takes 2-3 times longer at these shapes (benchmarks/README.md).
// A tile takes as many rows of x as keep its accumulators, x and a weight vector in
// registers: 16-float vectors and 4 rows with AVX-512's 32 registers, 8 floats and 2 rows
// with AVX2's 16 (16-float vectors there spill and halve the bandwidth: GPT-2 small's
// weights at batch 1, 10 against 20 GB/s on one core). One row of x (batch 1) is dotted
// with 8 rows of w at a time in 8-float vectors on either kind of machine: on two cores of
// an AMD EPYC with AVX-512, GPT-2 small's weights read at 30 GB/s so, against 26.5 with
// 16-float vectors and 26 with 4 rows of w (numpy's matrix-vector product: 32).
typedef float float8v __attribute__((vector_size(32)));
#ifdef __AVX512F__
typedef float float16v __attribute__((vector_size(64)));
typedef float16v FewRowsVector;
constexpr int kTileRows = 4;
#else
typedef float8v FewRowsVector;
constexpr int kTileRows = 2;
#endif
constexpr int kOneRowTile = 8;   // rows of w a tile takes with one row of x

template <typename V>
inline V loadv(const float *p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline float lane_sum(V v) {
  float total = 0.f;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) total += v[i];
  return total;
}

// y[q, r] = x[q] . w[r] (+ bias[r]) (+ residual[q, r]) for Q rows of x and R rows of w (row
// strides K; y's and the residual's stride N; bias and residual may be null), in vectors V
template <typename V, int Q, int R>
void dot_tile(const float *x, const float *w, const float *bias, const float *residual,
              float *y, int64_t n_stride, int64_t k_size) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  V acc[Q][R] = {};
  int64_t k = 0;
  for (; k + lanes <= k_size; k += lanes) {
    V xk[Q];
    for (int q = 0; q < Q; ++q) xk[q] = loadv<V>(x + q * k_size + k);
    for (int r = 0; r < R; ++r) {   // each weight vector straight into its products
      const V wk = loadv<V>(w + r * k_size + k);
      for (int q = 0; q < Q; ++q) acc[q][r] += xk[q] * wk;
    }
  }
  for (int q = 0; q < Q; ++q) {
    for (int r = 0; r < R; ++r) {
      float total = (bias ? bias[r] : 0.f) + lane_sum(acc[q][r]);
      for (int64_t j = k; j < k_size; ++j) total += x[q * k_size + j] * w[r * k_size + j];
      y[q * n_stride + r] = total + (residual ? residual[q * n_stride + r] : 0.f);
    }
  }
}

// Columns [n_begin, n_end) of y = x w^T (+ bias) (+ residual)
void skinny_columns(const float *x, const float *w, const float *bias, const float *residual,
                    float *y, int64_t m_size, int64_t n_size, int64_t k_size, int64_t n_begin,
                    int64_t n_end) {
  int64_t n = n_begin;
  if (m_size == 1) {
    for (; n + kOneRowTile <= n_end; n += kOneRowTile) {
      dot_tile<float8v, 1, kOneRowTile>(x, w + n * k_size, bias ? bias + n : nullptr,
                                        residual ? residual + n : nullptr, y + n, n_size,
                                        k_size);
    }
  }
  for (; n + 4 <= n_end; n += 4) {
    for (int64_t m = 0; m < m_size; m += kTileRows) {
      const float *xs = x + m * k_size, *ws = w + n * k_size, *bs = bias ? bias + n : nullptr;
      const float *rs = residual ? residual + m * n_size + n : nullptr;
      float *ys = y + m * n_size + n;
      switch (std::min<int64_t>(m_size - m, kTileRows)) {
        case 1: dot_tile<FewRowsVector, 1, 4>(xs, ws, bs, rs, ys, n_size, k_size); break;
        case 2: dot_tile<FewRowsVector, 2, 4>(xs, ws, bs, rs, ys, n_size, k_size); break;
        case 3: dot_tile<FewRowsVector, 3, 4>(xs, ws, bs, rs, ys, n_size, k_size); break;
        default: dot_tile<FewRowsVector, 4, 4>(xs, ws, bs, rs, ys, n_size, k_size); break;
      }
    }
  }
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < m_size; ++m) {
      float total = bias ? bias[n] : 0.f;
      for (int64_t k = 0; k < k_size; ++k) total += x[m * k_size + k] * w[n * k_size + k];
      y[m * n_size + n] = total + (residual ? residual[m * n_size + n] : 0.f);
    }
  }
}

// y (M, N) = x (M, K) w^T (+ bias (N)) (+ residual (M, N)) for few rows, the columns split
// over the usable cores in parts of whole tiles of at least 256 columns (MindSpore's own
// threads are idle while a kernel runs)
void few_rows_product(const float *x, const float *w, const float *bias, const float *residual,
                      float *y, int64_t m_size, int64_t n_size, int64_t k_size) {
  const int64_t blocks = n_size / kOneRowTile;   // a multiple of every tile's width
  parallel_for(blocks, 256 / kOneRowTile, [=](int64_t first, int64_t last, int) {
    const int64_t end = last == blocks ? n_size : kOneRowTile * last;
    skinny_columns(x, w, bias, residual, y, m_size, n_size, k_size, kOneRowTile * first, end);
  });
}

// The bias gradient: sums (N) of the columns of dy (M, N), the columns split over the cores
void column_sums(const float *dy, int64_t rows, int64_t columns, float *sums) {
  // parts of whole blocks of 16 columns, each part at least 64k elements
  const int64_t blocks = (columns + 15) / 16;
  parallel_for(blocks, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, 16 * rows)),
               [=](int64_t first, int64_t last, int) {
    const int64_t begin = 16 * first, end = std::min(columns, 16 * last);
    std::fill(sums + begin, sums + end, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = dy + r * columns;
#pragma omp simd
      for (int64_t c = begin; c < end; ++c) sums[c] += row[c];
    }
  });
}

// ---- Dense layers on oneDNN's sgemm ----
// MindSpore ships oneDNN (lib/libdnnl.so.3), built for a caller-supplied thread pool;
// cpu_kernels.py links it when it is there and defines MODEL_ZOO_DNNL. Its sgemm on the
// helpers runs a transformer's products faster than MindSpore's MatMul kernel on this
// project's machine (the benchmark prints both at the model's shapes: benchmarks/README.md),
// and one call takes the bias and, backward, both products. The pool interface follows
// oneDNN's include/oneapi/dnnl/dnnl_threadpool_iface.hpp.
#ifdef MODEL_ZOO_DNNL
extern "C" int dnnl_threadpool_interop_sgemm(char transa, char transb, int64_t m, int64_t n,
                                             int64_t k, float alpha, const float *a, int64_t lda,
                                             const float *b, int64_t ldb, float beta, float *c,
                                             int64_t ldc, void *threadpool);

namespace dnnl {
namespace threadpool_interop {
struct threadpool_iface {
  virtual int get_num_threads() const = 0;
  virtual bool get_in_parallel() const = 0;
  virtual void parallel_for(int n, const std::function<void(int, int)> &fn) = 0;
  virtual uint64_t get_flags() const = 0;   // 0: parallel_for returns when all work is done
  virtual ~threadpool_iface() {}
};
}  // namespace threadpool_interop
}  // namespace dnnl

thread_local bool in_parallel_for = false;

// oneDNN's work items 0..n-1, each a share claimed by the calling thread or a helper
class HelperThreadpool final : public dnnl::threadpool_interop::threadpool_iface {
 public:
  int get_num_threads() const override { return helpers().count() + 1; }
  bool get_in_parallel() const override { return in_parallel_for; }
  uint64_t get_flags() const override { return 0; }
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    const std::function<void(int)> item = [&](int index) {
      const bool outer = in_parallel_for;
      in_parallel_for = true;
      fn(index, n);
      in_parallel_for = outer;
    };
    if (n <= 1) {
      if (n == 1) item(0);
    } else {
      helpers().run(item, n);
    }
  }
};

extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k,
                          float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                          float beta, float *c, int64_t ldc);

// C (m, n) = op(A) op(B) + beta C, row-major with row strides lda, ldb and ldc, on all the
// cores; op transposes when trans is 'T'
bool sgemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, const float *a,
           int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  static HelperThreadpool pool;
  return dnnl_threadpool_interop_sgemm(trans_a, trans_b, m, n, k, 1.f, a, lda, b, ldb, beta, c,
                                       ldc, &pool) == 0;
}

// The same on contiguous matrices
bool sgemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, const float *a,
           const float *b, float beta, float *c) {
  return sgemm(trans_a, trans_b, m, n, k, a, trans_a == 'T' ? m : k, b, trans_b == 'T' ? k : n,
               beta, c, n);
}

// out (columns, rows) = in (rows, columns)^T; the rows of `in` are `in_stride` apart, those
// of `out` `out_stride`. Blocks of 16 columns are split over the cores.
void transpose(const float *in, int64_t rows, int64_t columns, int64_t in_stride, float *out,
               int64_t out_stride) {
  parallel_for((columns + 15) / 16, 1, [=](int64_t first, int64_t last, int) {
    for (int64_t c0 = 16 * first; c0 < std::min(columns, 16 * last); c0 += 16) {
      const int64_t c1 = std::min(columns, c0 + 16);
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t r1 = std::min(rows, r0 + 16);
        for (int64_t c = c0; c < c1; ++c) {
#pragma omp simd
          for (int64_t r = r0; r < r1; ++r) out[c * out_stride + r] = in[r * in_stride + c];
        }
      }
    }
  });
}

// The weight gradient dw (n, k) = dy^T x, for dy (m, n) and x (m, k). When dw is tall and
// narrow (n >= 4 k: the vocabulary projection, a feed-forward's first layer), oneDNN runs
// this product 20-25% slower than its transpose dw^T = x^T dy, whose rows are long (GPT-2
// small's vocabulary: 222 against 282 GFLOP/s). There it computes dw^T for blocks of 2048
// rows of dw into a scratch block (k x 2048 floats, kept per thread for the next call) and
// transposes each block into place.
bool weight_gradient(const float *dy, const float *x, int64_t m, int64_t n, int64_t k,
                     float *dw) {
  if (n < 4 * k) return sgemm('T', 'N', n, k, m, dy, x, 0.f, dw);
  constexpr int64_t kBlock = 2048;
  // kept for the life of the thread (a fresh block would fault its pages in every call):
  // k x 2048 floats per thread that runs a dense backward pass
  thread_local std::vector<float> scratch;
  scratch.resize(std::max<size_t>(scratch.size(), k * std::min(n, kBlock)));
  for (int64_t first = 0; first < n; first += kBlock) {
    const int64_t rows = std::min(kBlock, n - first);
    if (!sgemm('T', 'N', k, rows, m, x, k, dy + first, n, 0.f, scratch.data(), rows)) {
      return false;
    }
    transpose(scratch.data(), k, rows, rows, dw + first * k, k);
  }
  return true;
}

// The same with a factor, leading dimensions (row strides) of its own and c = ab + beta c,
// on this thread only: for the many small products of attention, split over the cores by head
bool small_sgemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc, float beta = 0.f) {
  return dnnl_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == 0;
}

// y = x w^T (+ bias). inputs: x (M, K), w (N, K), optionally bias (N); outputs: y (M, N)
extern "C" int DenseForward(AOT_ARGS) {
  Clocked clocked("DenseForward");
  if ((nparam != 3 && nparam != 4) || !all_float32(nparam, dtypes) || ndims[0] != 2 ||
      ndims[1] != 2 || shapes[0][1] != shapes[1][1]) {
    return 1;
  }
  const int64_t m = shapes[0][0], k = shapes[0][1], n = shapes[1][0];
  const float *x = as_float(params[0]), *w = as_float(params[1]);
  float *y = as_float(params[nparam - 1]);
  if (nparam == 4) {   // start from the bias in every row, then accumulate onto it
    if (ndims[2] != 1 || shapes[2][0] != n) return 1;
    const float *bias = as_float(params[2]);
    parallel_for(m, row_grain(n), [=](int64_t begin, int64_t end, int) {
      for (int64_t r = begin; r < end; ++r) std::memcpy(y + r * n, bias, n * sizeof(float));
    });
  }
  return sgemm('N', 'T', m, n, k, x, w, nparam == 4 ? 1.f : 0.f, y) ? 0 : 1;
}

// The gradients of DenseForward: dx = dy w, dw = dy^T x (and dbias = column sums of dy).
// inputs: dy (M, N), x (M, K), w (N, K); outputs: dx (M, K), dw (N, K), optionally db (N)
extern "C" int DenseBackward(AOT_ARGS) {
  if ((nparam != 5 && nparam != 6) || !all_float32(nparam, dtypes) || ndims[0] != 2 ||
      ndims[1] != 2 || ndims[2] != 2) {
    return 1;
  }
  const int64_t m = shapes[0][0], n = shapes[0][1], k = shapes[1][1];
  if (shapes[1][0] != m || shapes[2][0] != n || shapes[2][1] != k) return 1;
  const float *dy = as_float(params[0]), *x = as_float(params[1]), *w = as_float(params[2]);
  float *dx = as_float(params[3]), *dw = as_float(params[4]);
  if (!sgemm('N', 'N', m, k, n, dy, w, 0.f, dx) || !weight_gradient(dy, x, m, n, k, dw)) {
    return 1;
  }
  if (nparam == 6) column_sums(dy, m, n, as_float(params[5]));
  return 0;
}

// The same with a bias, under names of their own: MindSpore keeps one backward graph per
// custom operator's function, so the two arities need two
extern "C" int DenseBiasForward(AOT_ARGS) { return nparam == 4 ? DenseForward(AOT_PASS_ALL) : 1; }
extern "C" int DenseBiasBackward(AOT_ARGS) {
  return nparam == 6 ? DenseBackward(AOT_PASS_ALL) : 1;
}

// ---- Attention in one kernel per direction ----
// Scores, masks, softmax, dropout and context for every (batch, head) pair, the pairs
// split over the cores. Queries, keys and values are read where the projections left them:
// self attention's fused projection (batch, seq, heads, 3, head_dim), or a query projection
// (batch, seq_q, heads, head_dim) and a fused key-value projection (batch, seq_k, kv_heads,
// 2, head_dim) (`fuse_head_projections`): cross attention, or grouped-query self attention
// where each of kv_heads key/value heads serves heads / kv_heads query heads in a row. The
// context is written as (batch, seq_q, heads x head_dim), and the gradients land in the
// projections' layouts: no slices, no transposes and no repeated keys, forward or backward.
// The probabilities (batch, heads, seq_q, seq_k) are kept for the backward pass; the dropout
// mask is regenerated from its key, element for element the mask KeyedDropout draws on the
// probabilities tensor, so the results are the unfused layers' up to float rounding.
struct AttentionLayout {
  int64_t batch, heads, head_dim, seq_q, seq_k;
  int64_t q_row, kv_row;     // row strides of the query and key-value sources
  int64_t q_head, kv_head;   // offsets from one head to the next in them
  int64_t k_part;            // offset of a head's key from its first column (v follows)
  int64_t kv_heads;          // key/value heads, each read by heads / kv_heads query heads

  static AttentionLayout self(const int64_t *qkv_shape, int64_t heads) {
    const int64_t d = heads > 0 ? qkv_shape[2] / (3 * heads) : 0;
    return {qkv_shape[0], heads, d, qkv_shape[1], qkv_shape[1], qkv_shape[2], qkv_shape[2],
            3 * d, 3 * d, d, heads};
  }
  static AttentionLayout split(const int64_t *q_shape, const int64_t *kv_shape,
                               int64_t heads) {
    const int64_t d = heads > 0 ? q_shape[2] / heads : 0;
    return {q_shape[0], heads, d, q_shape[1], kv_shape[1], q_shape[2], kv_shape[2], d, 2 * d,
            0, d > 0 ? kv_shape[2] / (2 * d) : 0};
  }
  int64_t group() const { return heads / kv_heads; }
  // Whether the projections' widths hold whole heads (parts_q: 3 for self attention's
  // qkv, 1 for a query; kv_heads dividing heads) and the other tensors have the shapes this
  // layout needs: probs (B, H, Lq, Lk), bias (B, Lk), context (B, Lq, H D)
  bool fits(int64_t width_q, int64_t width_kv, int64_t parts_q, int probs_ndim,
            const int64_t *probs, int bias_ndim, const int64_t *bias, int context_ndim,
            const int64_t *context) const {
    const int64_t hidden = heads * head_dim;
    return batch > 0 && head_dim > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
           width_q == parts_q * hidden &&
           width_kv == (parts_q == 3 ? 3 * hidden : 2 * kv_heads * head_dim) &&
           probs_ndim == 4 && probs[0] == batch && probs[1] == heads && probs[2] == seq_q &&
           probs[3] == seq_k &&
           (bias == nullptr || (bias_ndim == 2 && bias[0] == batch && bias[1] == seq_k)) &&
           context_ndim == 3 && context[0] == batch && context[1] == seq_q &&
           context[2] == hidden;
  }
  int64_t q_at(int64_t b, int64_t h) const { return b * seq_q * q_row + h * q_head; }
  int64_t k_at(int64_t b, int64_t h) const {
    return b * seq_k * kv_row + h / group() * kv_head + k_part;
  }
  int64_t v_offset() const { return head_dim; }   // a head's value follows its key
  int64_t probs_at(int64_t b, int64_t h) const { return (b * heads + h) * seq_q * seq_k; }
};

// Causal attention over 128 positions or more runs in blocks of 32 query rows (and keys),
// each block only over the keys its rows may see: 62.5% of the products and of the softmax
// at 128. Shorter sequences run whole: there the products of a block are so small that
// calling them cost more than the masked part (GPT-2 tiny, 64 positions: 2% slower).
int64_t causal_block(bool causal, int64_t seq) {
  constexpr int64_t kBlock = 32;
  return causal && seq >= 4 * kBlock ? kBlock : seq;
}

// The keys query rows first .. first + rows - 1 see: those up to the last of them when
// causal, else all
int64_t keys_seen(bool causal, int64_t first, int64_t rows, int64_t seq_k) {
  return causal ? std::min(seq_k, first + rows) : seq_k;
}

// probs (B, H, Lq, Lk) before dropout and context (B, Lq, H D) of q over k, v; bias (B, Lk)
// is added to each key's scores, and with `causal` the later keys are masked (their
// probabilities are 0, and the blocks of keys after a block of rows are skipped)
int attention_forward(const AttentionLayout &at, const float *q_source,
                      const float *kv_source, const float *bias, bool causal,
                      const KeyedMask &mask, float *context, float *probs) {
  const int64_t lq = at.seq_q, lk = at.seq_k, d = at.head_dim, hidden = at.heads * d;
  if (causal && lq != lk) return 1;   // causal masks are for attention over its own sequence
  const int64_t block = causal_block(causal, lq);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::atomic<int> failed{0};
  std::atomic<int> *any_failed = &failed;
  // each part's scratch, allocated here: an allocation failing on a helper would end the
  // process
  std::vector<float> scratch(mask.drops ? parts_for(at.batch * at.heads, 1) * lq * lk : 0);
  float *const scratch_base = scratch.data();
  parallel_for(at.batch * at.heads, 1, [=](int64_t begin, int64_t end, int part) {
    float *const dropped = scratch_base + part * lq * lk;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / at.heads, h = pair % at.heads;
      const float *q = q_source + at.q_at(b, h), *k = kv_source + at.k_at(b, h);
      const float *v = k + at.v_offset(), *row_bias = bias + b * lk;
      float *p = probs + at.probs_at(b, h);
      for (int64_t first = 0; first < lq; first += block) {
        const int64_t rows = std::min(block, lq - first);
        const int64_t keys = keys_seen(causal, first, rows, lk);
        float *p_rows = p + first * lk;
        // scores (rows, keys) = scale q k^T, then + masks, then softmax along each row
        if (!small_sgemm('N', 'T', rows, keys, d, scale, q + first * at.q_row, at.q_row, k,
                         at.kv_row, p_rows, lk)) {
          any_failed->store(1);
          return;
        }
        for (int64_t i = first; i < first + rows; ++i) {
          float *row = p + i * lk;
          float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
          for (int64_t j = 0; j < keys; ++j) {
            const float score = row[j] + row_bias[j] + (causal && j > i ? kMaskValue : 0.f);
            row[j] = score;
            peak = score > peak ? score : peak;
          }
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < keys; ++j) {
            row[j] = exp_approx(row[j] - peak);
            total += row[j];
          }
          const float inverse = 1.f / total;
#pragma omp simd
          for (int64_t j = 0; j < keys; ++j) row[j] *= inverse;
          std::fill(row + keys, row + lk, 0.f);
        }
        const float *used = p_rows;   // the probabilities after dropout
        if (mask.drops) {
          mask.apply(p_rows, dropped, at.probs_at(b, h) + first * lk, rows * lk);
          used = dropped;
        }
        // context (rows, D) = probs v, into its place in (B, Lq, H D)
        if (!small_sgemm('N', 'N', rows, d, keys, 1.f, used, lk, v, at.kv_row,
                         context + (b * lq + first) * hidden + h * d, hidden)) {
          any_failed->store(1);
          return;
        }
      }
    }
  });
  return failed.load();
}

// The gradients of attention_forward: dq into dq_source, dk and dv into dkv_source (the
// same tensor as dq_source for self attention), each in its projection's layout. dq comes
// by blocks of query rows, dk and dv by blocks of keys, each over the rows that see them.
// The work is split by key/value head: the query heads of its group run in turn, the first
// writing dk and dv and the others adding to them.
int attention_backward(const AttentionLayout &at, const float *q_source,
                       const float *kv_source, const float *dcontext, const float *probs,
                       bool causal, const KeyedMask &mask, float *dq_source,
                       float *dkv_source) {
  const int64_t lq = at.seq_q, lk = at.seq_k, d = at.head_dim, hidden = at.heads * d;
  if (causal && lq != lk) return 1;
  const int64_t row_block = causal_block(causal, lq), key_block = causal_block(causal, lk);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::atomic<int> failed{0};
  std::atomic<int> *any_failed = &failed;
  // each part's scratch (the scores' gradient, the dropped probabilities), allocated here
  const int64_t block = (mask.drops ? 2 : 1) * lq * lk;
  std::vector<float> scratch(parts_for(at.batch * at.kv_heads, 1) * block);
  float *const scratch_base = scratch.data();
  const int64_t group = at.group();
  parallel_for(at.batch * at.kv_heads, 1, [=](int64_t begin, int64_t end, int part) {
    float *const grad = scratch_base + part * block, *const dropped = grad + lq * lk;
    // (b, kv head) pairs begin .. end - 1 are query pairs (b, h) begin x group .. on
    for (int64_t pair = begin * group; pair < end * group; ++pair) {
      const int64_t b = pair / at.heads, h = pair % at.heads, offset = at.probs_at(b, h);
      const float kv_beta = h % group == 0 ? 0.f : 1.f;   // the group's first head writes
      const float *q = q_source + at.q_at(b, h), *k = kv_source + at.k_at(b, h);
      const float *v = k + at.v_offset(), *p = probs + offset;
      const float *dout = dcontext + b * lq * hidden + h * d;
      float *dq = dq_source + at.q_at(b, h), *dk = dkv_source + at.k_at(b, h);
      float *dv = dk + at.v_offset();
      const float *used = p;
      if (mask.drops) {
        mask.apply(p, dropped, offset, lq * lk);
        used = dropped;
      }
      bool done = true;
      for (int64_t first = 0; done && first < lq; first += row_block) {
        const int64_t rows = std::min(row_block, lq - first);
        const int64_t keys = keys_seen(causal, first, rows, lk);
        float *g_rows = grad + first * lk;
        // d(used) = dout v^T
        done = small_sgemm('N', 'T', rows, keys, d, 1.f, dout + first * hidden, hidden, v,
                           at.kv_row, g_rows, lk);
        // back through dropout, then softmax: dscores = p (dp - sum_j dp p)
        for (int64_t i = first; done && i < first + rows; ++i) {
          float *g = grad + i * lk;
          const float *row = p + i * lk;
          if (mask.drops) mask.apply(g, g, offset + i * lk, keys);
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < keys; ++j) dot += g[j] * row[j];
#pragma omp simd
          for (int64_t j = 0; j < keys; ++j) g[j] = row[j] * (g[j] - dot);
        }
        // dq = scale dscores k
        done = done && small_sgemm('N', 'N', rows, d, keys, scale, g_rows, lk, k, at.kv_row,
                                   dq + first * at.q_row, at.q_row);
      }
      for (int64_t first = 0; done && first < lk; first += key_block) {
        const int64_t keys = std::min(key_block, lk - first);
        const int64_t from = causal ? first : 0;   // the first query row that sees them
        // dv = used^T dout; dk = scale dscores^T q, over the rows from `from`
        done = small_sgemm('T', 'N', keys, d, lq - from, 1.f, used + from * lk + first, lk,
                           dout + from * hidden, hidden, dv + first * at.kv_row, at.kv_row,
                           kv_beta) &&
               small_sgemm('T', 'N', keys, d, lq - from, scale, grad + from * lk + first, lk,
                           q + from * at.q_row, at.q_row, dk + first * at.kv_row, at.kv_row,
                           kv_beta);
      }
      if (!done) {
        any_failed->store(1);
        return;
      }
    }
  });
  return failed.load();
}

// The dtypes: `floats` float32 tensors, then from `key_at` the key int32 (4) and keep
// float32 (1), then float32 outputs
bool attention_inputs(int nparam, const char **dtypes, int *ndims, int64_t **shapes,
                      int floats, int key_at) {
  for (int i = 0; i < nparam; ++i) {
    const bool is_int32 = std::strcmp(dtypes[i], "int32") == 0;
    const bool expect_int32 = i == key_at || (i >= floats && i < key_at);
    if (is_int32 != expect_int32 || (!is_int32 && !all_float32(1, dtypes + i))) return false;
  }
  return ndims[key_at] == 1 && shapes[key_at][0] == 4 && elements(ndims[key_at + 1],
                                                                   shapes[key_at + 1]) == 1;
}

// inputs: qkv (B, L, 3 H D), bias (B, L), causal int32 (1), key int32 (4), keep (1);
// outputs: context (B, L, H D), probs (B, H, L, L)
extern "C" int SelfAttentionForward(AOT_ARGS) {
  if (nparam != 7 || !attention_inputs(nparam, dtypes, ndims, shapes, 2, 3) || ndims[0] != 3 ||
      ndims[6] != 4) {
    return 1;
  }
  const AttentionLayout at = AttentionLayout::self(shapes[0], shapes[6][1]);
  if (!at.fits(shapes[0][2], shapes[0][2], 3, ndims[6], shapes[6], ndims[1], shapes[1],
               ndims[5], shapes[5])) {
    return 1;
  }
  const float *qkv = as_float(params[0]);
  return attention_forward(at, qkv, qkv, as_float(params[1]),
                           *static_cast<const int32_t *>(params[2]) != 0,
                           KeyedMask(static_cast<const int32_t *>(params[3]),
                                     *as_float(params[4])),
                           as_float(params[5]), as_float(params[6]));
}

// inputs: dcontext (B, L, H D), qkv, probs (B, H, L, L), causal int32 (1), key int32 (4),
// keep (1); outputs: dqkv (B, L, 3 H D)
extern "C" int SelfAttentionBackward(AOT_ARGS) {
  if (nparam != 7 || !attention_inputs(nparam, dtypes, ndims, shapes, 3, 4) || ndims[1] != 3 ||
      ndims[2] != 4 || ndims[6] != 3 || shapes[6][0] != shapes[1][0] ||
      shapes[6][1] != shapes[1][1] || shapes[6][2] != shapes[1][2]) {
    return 1;
  }
  const AttentionLayout at = AttentionLayout::self(shapes[1], shapes[2][1]);
  if (!at.fits(shapes[1][2], shapes[1][2], 3, ndims[2], shapes[2], 0, nullptr, ndims[0],
               shapes[0])) {
    return 1;
  }
  const float *qkv = as_float(params[1]);
  float *dqkv = as_float(params[6]);
  return attention_backward(at, qkv, qkv, as_float(params[0]), as_float(params[2]),
                            *static_cast<const int32_t *>(params[3]) != 0,
                            KeyedMask(static_cast<const int32_t *>(params[4]),
                                      *as_float(params[5])),
                            dqkv, dqkv);
}

// Attention of a query projection over a fused key-value projection of kv_heads heads:
// cross attention (causal 0), or grouped-query self attention (causal non-zero, Lq = Lk).
// inputs: q (B, Lq, H D), kv (B, Lk, 2 Hkv D), bias (B, Lk), causal int32 (1), key int32
// (4), keep (1); outputs: context (B, Lq, H D), probs (B, H, Lq, Lk)
extern "C" int KvAttentionForward(AOT_ARGS) {
  if (nparam != 8 || !attention_inputs(nparam, dtypes, ndims, shapes, 3, 4) || ndims[0] != 3 ||
      ndims[1] != 3 || ndims[7] != 4 || shapes[1][0] != shapes[0][0]) {
    return 1;
  }
  const AttentionLayout at = AttentionLayout::split(shapes[0], shapes[1], shapes[7][1]);
  if (!at.fits(shapes[0][2], shapes[1][2], 1, ndims[7], shapes[7], ndims[2], shapes[2],
               ndims[6], shapes[6])) {
    return 1;
  }
  return attention_forward(at, as_float(params[0]), as_float(params[1]), as_float(params[2]),
                           *static_cast<const int32_t *>(params[3]) != 0,
                           KeyedMask(static_cast<const int32_t *>(params[4]),
                                     *as_float(params[5])),
                           as_float(params[6]), as_float(params[7]));
}

// inputs: dcontext (B, Lq, H D), q, kv, probs (B, H, Lq, Lk), causal int32 (1), key int32
// (4), keep (1); outputs: dq (B, Lq, H D), dkv (B, Lk, 2 Hkv D)
extern "C" int KvAttentionBackward(AOT_ARGS) {
  if (nparam != 9 || !attention_inputs(nparam, dtypes, ndims, shapes, 4, 5) || ndims[1] != 3 ||
      ndims[2] != 3 || ndims[3] != 4 || shapes[2][0] != shapes[1][0]) {
    return 1;
  }
  const AttentionLayout at = AttentionLayout::split(shapes[1], shapes[2], shapes[3][1]);
  if (!at.fits(shapes[1][2], shapes[2][2], 1, ndims[3], shapes[3], 0, nullptr, ndims[0],
               shapes[0])) {
    return 1;
  }
  return attention_backward(at, as_float(params[1]), as_float(params[2]), as_float(params[0]),
                            as_float(params[3]), *static_cast<const int32_t *>(params[4]) != 0,
                            KeyedMask(static_cast<const int32_t *>(params[5]),
                                      *as_float(params[6])),
                            as_float(params[7]), as_float(params[8]));
}

// ---- Mixture of experts: each expert's products on the rows routed to it ----
// The k choices of T tokens are T k rows r = t k + j, sorted by expert (counting sort, in
// row order within an expert): expert e takes rows order[offset[e] .. offset[e + 1]), and
// row r sits at position[r]. Dropless: every choice is computed.
struct ExpertRows {
  ExpertRows(const int32_t *chosen, int64_t rows, int64_t experts)
      : offset(experts + 1, 0), order(rows), position(rows) {
    for (int64_t r = 0; r < rows; ++r) ++offset[chosen[r] + 1];
    for (int64_t e = 0; e < experts; ++e) offset[e + 1] += offset[e];
    std::vector<int64_t> next(offset.begin(), offset.end() - 1);
    for (int64_t r = 0; r < rows; ++r) {
      position[r] = next[chosen[r]]++;
      order[position[r]] = r;
    }
  }
  bool valid(const int32_t *chosen, int64_t rows, int64_t experts) const {
    for (int64_t r = 0; r < rows; ++r) {
      if (chosen[r] < 0 || chosen[r] >= experts) return false;
    }
    return true;
  }
  std::vector<int64_t> offset, order, position;
};

// Rows `first` .. `first + count` of the sorted order, as token rows of x (T, H) side by side
void gather_rows(const float *x, const int64_t *order, int64_t first, int64_t count, int64_t k,
                 int64_t hidden, float *out) {
  parallel_for(count, row_grain(hidden), [=](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(out + i * hidden, x + order[first + i] / k * hidden, hidden * sizeof(float));
    }
  });
}

// a = silu(g) u for one routed row whose gate and up products lie side by side (g, u)
inline void swiglu_row(const float *products, int64_t width, float *a) {
  const float *g = products, *u = products + width;
#pragma omp simd
  for (int64_t c = 0; c < width; ++c) a[c] = g[c] * sigmoid_approx(g[c]) * u[c];
}

struct MoeShapes {
  int64_t tokens, k, hidden, experts, width;
  // x (T, H), chosen (T, k), weights (T, k), gate (E, H, F), up (E, H, F), down (E, F, H)
  static bool read(int *ndims, int64_t **shapes, MoeShapes *s) {
    if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 || ndims[4] != 3 ||
        ndims[5] != 3) {
      return false;
    }
    *s = {shapes[0][0], shapes[1][1], shapes[0][1], shapes[3][0], shapes[3][2]};
    return shapes[1][0] == s->tokens && shapes[2][0] == s->tokens && shapes[2][1] == s->k &&
           shapes[3][1] == s->hidden && shapes[4][0] == s->experts &&
           shapes[4][1] == s->hidden && shapes[4][2] == s->width &&
           shapes[5][0] == s->experts && shapes[5][1] == s->width && shapes[5][2] == s->hidden;
  }
};

bool moe_dtypes(int nparam, const char **dtypes) {
  for (int i = 0; i < nparam; ++i) {
    if (i != 1 && std::strcmp(dtypes[i], "float32") != 0 && std::strcmp(dtypes[i], "float") != 0)
      return false;
  }
  return std::strcmp(dtypes[1], "int32") == 0;
}

// inputs: x (T, H), chosen (T, k) int32, weights (T, k), gate (E, H, F), up (E, H, F),
// down (E, F, H); outputs: y (T, H) = sum_j weights[t, j] down_e(silu(gate_e x_t) up_e x_t)
// with e = chosen[t, j]; and for the backward pass, in the sorted order, each row's gate
// and up products (T k, 2F) and its expert's output (T k, H)
extern "C" int MoeExpertsForward(AOT_ARGS) {
  MoeShapes s;
  if (nparam != 9 || !moe_dtypes(nparam, dtypes) || !MoeShapes::read(ndims, shapes, &s)) {
    return 1;
  }
  const float *x = as_float(params[0]), *weights = as_float(params[2]);
  const float *gate = as_float(params[3]), *up = as_float(params[4]);
  const float *down = as_float(params[5]);
  const int32_t *chosen = static_cast<const int32_t *>(params[1]);
  float *y = as_float(params[6]), *products = as_float(params[7]);
  float *expert_out = as_float(params[8]);
  const int64_t rows = s.tokens * s.k, H = s.hidden, F = s.width, k = s.k;
  const ExpertRows routed(chosen, rows, s.experts);
  if (!routed.valid(chosen, rows, s.experts)) return 1;
  thread_local std::vector<float> inputs, active;
  inputs.resize(std::max<size_t>(inputs.size(), rows * H));
  active.resize(std::max<size_t>(active.size(), rows * F));
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t first = routed.offset[e], n = routed.offset[e + 1] - first;
    if (n == 0) continue;
    float *xe = inputs.data(), *ae = active.data(), *pe = products + first * 2 * F;
    gather_rows(x, routed.order.data(), first, n, k, H, xe);
    if (!sgemm('N', 'N', n, F, H, xe, H, gate + e * H * F, F, 0.f, pe, 2 * F) ||
        !sgemm('N', 'N', n, F, H, xe, H, up + e * H * F, F, 0.f, pe + F, 2 * F)) {
      return 1;
    }
    parallel_for(n, row_grain(F), [=](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) swiglu_row(pe + i * 2 * F, F, ae + i * F);
    });
    if (!sgemm('N', 'N', n, H, F, ae, down + e * F * H, 0.f, expert_out + first * H)) return 1;
  }
  const int64_t *position = routed.position.data();
  parallel_for(s.tokens, row_grain(H * k), [=](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t) {
      float *yt = y + t * H;
      std::memset(yt, 0, H * sizeof(float));
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const float *o = expert_out + position[t * k + j] * H;
#pragma omp simd
        for (int64_t c = 0; c < H; ++c) yt[c] += w * o[c];
      }
    }
  });
  return 0;
}

// The gradients of MoeExpertsForward. inputs: dy (T, H), its six inputs, its two saved
// outputs; outputs: dx (T, H), dweights (T, k), dgate, dup, ddown
extern "C" int MoeExpertsBackward(AOT_ARGS) {
  MoeShapes s;
  if (nparam != 14 || !moe_dtypes(nparam - 1, dtypes + 1) ||
      !MoeShapes::read(ndims + 1, shapes + 1, &s)) {
    return 1;
  }
  const float *dy = as_float(params[0]), *x = as_float(params[1]);
  const int32_t *chosen = static_cast<const int32_t *>(params[2]);
  const float *weights = as_float(params[3]), *gate = as_float(params[4]);
  const float *up = as_float(params[5]), *down = as_float(params[6]);
  const float *products = as_float(params[7]), *expert_out = as_float(params[8]);
  float *dx = as_float(params[9]), *dweights = as_float(params[10]);
  float *dgate = as_float(params[11]), *dup = as_float(params[12]);
  float *ddown = as_float(params[13]);
  const int64_t rows = s.tokens * s.k, H = s.hidden, F = s.width, k = s.k;
  const ExpertRows routed(chosen, rows, s.experts);
  if (!routed.valid(chosen, rows, s.experts)) return 1;
  const int64_t *position = routed.position.data(), *order = routed.order.data();
  // dweights[t, j] = dy_t . (the chosen expert's output for t)
  parallel_for(rows, row_grain(H), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *d = dy + r / k * H, *o = expert_out + position[r] * H;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < H; ++c) sum += d[c] * o[c];
      dweights[r] = sum;
    }
  });
  std::memset(dx, 0, s.tokens * H * sizeof(float));
  thread_local std::vector<float> inputs, active, d_out, d_products, d_inputs;
  inputs.resize(std::max<size_t>(inputs.size(), rows * H));
  d_out.resize(std::max<size_t>(d_out.size(), rows * H));
  d_inputs.resize(std::max<size_t>(d_inputs.size(), rows * H));
  active.resize(std::max<size_t>(active.size(), rows * F));
  d_products.resize(std::max<size_t>(d_products.size(), rows * 2 * F));
  for (int64_t e = 0; e < s.experts; ++e) {
    float *dge = dgate + e * H * F, *due = dup + e * H * F, *dde = ddown + e * F * H;
    const int64_t first = routed.offset[e], n = routed.offset[e + 1] - first;
    if (n == 0) {   // no token chose it
      std::memset(dge, 0, H * F * sizeof(float));
      std::memset(due, 0, H * F * sizeof(float));
      std::memset(dde, 0, F * H * sizeof(float));
      continue;
    }
    const float *pe = products + first * 2 * F;
    float *ae = active.data(), *doe = d_out.data(), *dpe = d_products.data();
    float *xe = inputs.data(), *dxe = d_inputs.data();
    // the expert's output gradient (weights[r] dy_t) and its activations again
    parallel_for(n, row_grain(H + F), [=](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = order[first + i];
        const float w = weights[r], *d = dy + r / k * H;
        float *o = doe + i * H;
#pragma omp simd
        for (int64_t c = 0; c < H; ++c) o[c] = w * d[c];
        swiglu_row(pe + i * 2 * F, F, ae + i * F);
      }
    });
    // ddown = a^T d_out; d_active = d_out down^T (into the gate half of d_products)
    if (!sgemm('T', 'N', F, H, n, ae, doe, 0.f, dde) ||
        !sgemm('N', 'T', n, F, H, doe, H, down + e * F * H, H, 0.f, dpe, 2 * F)) {
      return 1;
    }
    // dg = da u silu'(g), du = da silu(g), silu'(g) = s (1 + g (1 - s))
    parallel_for(n, row_grain(2 * F), [=](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) {
        const float *g = pe + i * 2 * F, *u = g + F;
        float *dg = dpe + i * 2 * F, *du = dg + F;
#pragma omp simd
        for (int64_t c = 0; c < F; ++c) {
          const float sg = sigmoid_approx(g[c]), da = dg[c];
          dg[c] = da * u[c] * sg * (1.f + g[c] * (1.f - sg));
          du[c] = da * g[c] * sg;
        }
      }
    });
    gather_rows(x, order, first, n, k, H, xe);
    // dgate = x^T dg, dup = x^T du; dx = dg gate^T + du up^T
    if (!sgemm('T', 'N', H, F, n, xe, H, dpe, 2 * F, 0.f, dge, F) ||
        !sgemm('T', 'N', H, F, n, xe, H, dpe + F, 2 * F, 0.f, due, F) ||
        !sgemm('N', 'T', n, H, F, dpe, 2 * F, gate + e * H * F, F, 0.f, dxe, H) ||
        !sgemm('N', 'T', n, H, F, dpe + F, 2 * F, up + e * H * F, F, 1.f, dxe, H)) {
      return 1;
    }
    // each token at most once an expert: the rows add to distinct rows of dx
    parallel_for(n, row_grain(H), [=](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) {
        float *d = dx + order[first + i] / k * H;
        const float *g = dxe + i * H;
#pragma omp simd
        for (int64_t c = 0; c < H; ++c) d[c] += g[c];
      }
    });
  }
  return 0;
}
#endif  // MODEL_ZOO_DNNL

// inputs: x (M, K), w (N, K), optionally bias (N); outputs: y (M, N)
extern "C" int SkinnyMatMul(AOT_ARGS) {
  Clocked clocked("SkinnyMatMul");
  if ((nparam != 3 && nparam != 4) || !all_float32(nparam, dtypes) || ndims[0] != 2 ||
      ndims[1] != 2) {
    return 1;
  }
  const int64_t m_size = shapes[0][0], k_size = shapes[0][1], n_size = shapes[1][0];
  if (shapes[1][1] != k_size || (nparam == 4 && shapes[2][0] != n_size)) return 1;
  few_rows_product(as_float(params[0]), as_float(params[1]),
                   nparam == 4 ? as_float(params[2]) : nullptr, nullptr,
                   as_float(params[nparam - 1]), m_size, n_size, k_size);
  return 0;
}

// The same with a bias, under a name of its own (see DenseBiasForward)
extern "C" int SkinnyMatMulBias(AOT_ARGS) {
  return nparam == 4 ? SkinnyMatMul(AOT_PASS_ALL) : 1;
}

// A beam search step's cache: out[r] = cache[parents[r]] up to the step's position, the
// new key or value at it, zeros after it (those positions are masked until written; zeros
// keep their scores finite). One pass that reads only the positions decoded so far, where
// a gather then a scatter would copy the whole cache twice. inputs: cache (R, H, L, D),
// parents int32 (R), index int32 (R, H, 1, 3) (cache_index: the position is its last
// entry), new (R, H, 1, D); outputs: out (R, H, L, D). float32.
extern "C" int ReorderCache(AOT_ARGS) {
  Clocked clocked("ReorderCache");
  if (nparam != 5 || std::strcmp(dtypes[1], "int32") != 0 ||
      std::strcmp(dtypes[2], "int32") != 0 || ndims[0] != 4) {
    return 1;
  }
  const float *cache = as_float(params[0]), *fresh = as_float(params[3]);
  const int32_t *parents = static_cast<const int32_t *>(params[1]);
  const int32_t position = static_cast<const int32_t *>(params[2])[2];
  float *out = as_float(params[4]);
  const int64_t rows = shapes[0][0], heads = shapes[0][1], length = shapes[0][2],
                depth = shapes[0][3];
  if (position < 0 || position >= length) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    if (parents[r] < 0 || parents[r] >= rows) return 1;
  }
  const int64_t kept = position * depth, plane = length * depth;
  parallel_for(rows * heads, 1, [=](int64_t begin, int64_t end, int) {
    for (int64_t plane_index = begin; plane_index < end; ++plane_index) {
      const int64_t r = plane_index / heads, h = plane_index % heads;
      const float *source = cache + (parents[r] * heads + h) * plane;
      float *target = out + plane_index * plane;
      std::memcpy(target, source, kept * sizeof(float));
      std::memcpy(target + kept, fresh + plane_index * depth, depth * sizeof(float));
      std::fill(target + kept + depth, target + plane, 0.f);
    }
  });
  return 0;
}

// One decoding step's attention over key/value caches it writes in place, for B rows, H
// query heads and G key/value heads (G divides H; each serves H / G query heads in turn).
// Strides in floats: the query of (row b, head h) is at q + b q_row + h q_head (D floats),
// the newest key of (b, g) at kv + b kv_row + g kv_head and its value D floats after it;
// the caches are (B, G, L, D) and the context (B, H D).
struct StepAttention {
  const float *q;
  int64_t q_row, q_head;
  const float *kv;
  int64_t kv_row, kv_head;
  float *keys, *values, *context;
  int64_t batch, heads, groups, length, depth;
};

// For every (row, key/value head): the newest key and value written into the caches at
// `position`, then each of its query heads attending over positions 0 .. position (later
// ones are not read). false when the position is outside the caches.
bool attend_step(const StepAttention &a, int64_t position) {
  if (position < 0 || position >= a.length) return false;
  const float scale = 1.f / std::sqrt(static_cast<float>(a.depth));
  const int64_t seen = position + 1, per_group = a.heads / a.groups, depth = a.depth;
  std::vector<float> scratch(parts_for(a.batch * a.groups, 1) * seen);
  float *const scratch_base = scratch.data();
  parallel_for(a.batch * a.groups, 1, [=](int64_t begin, int64_t end, int part) {
    float *const scores = scratch_base + part * seen;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / a.groups, g = pair % a.groups;
      const float *fresh = a.kv + b * a.kv_row + g * a.kv_head;
      float *k = a.keys + pair * a.length * depth, *v = a.values + pair * a.length * depth;
      std::memcpy(k + position * depth, fresh, depth * sizeof(float));
      std::memcpy(v + position * depth, fresh + depth, depth * sizeof(float));
      for (int64_t h = g * per_group; h < (g + 1) * per_group; ++h) {
        const float *q = a.q + b * a.q_row + h * a.q_head;
        float peak = -INFINITY;
        for (int64_t j = 0; j < seen; ++j) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < depth; ++i) dot += q[i] * k[j * depth + i];
          scores[j] = dot * scale;
          peak = std::max(peak, scores[j]);
        }
        float total = 0.f;
        for (int64_t j = 0; j < seen; ++j) {
          scores[j] = exp_approx(scores[j] - peak);
          total += scores[j];
        }
        float *out = a.context + b * a.heads * depth + h * depth;
        std::fill(out, out + depth, 0.f);
        for (int64_t j = 0; j < seen; ++j) {
          const float weight = scores[j] / total;
#pragma omp simd
          for (int64_t i = 0; i < depth; ++i) out[i] += weight * v[j * depth + i];
        }
      }
    }
  });
  return true;
}

// Whether inputs c and c + 1 are float32 caches (B, G, L, D) of one shape and input c + 2
// their index, int32 (B, G, 1, 3)
bool cache_inputs(int c, int *ndims, int64_t **shapes, const char **dtypes) {
  return ndims[c] == 4 && ndims[c + 1] == 4 && ndims[c + 2] == 4 &&
         std::memcmp(shapes[c], shapes[c + 1], 4 * sizeof(int64_t)) == 0 &&
         elements(4, shapes[c]) > 0 && all_float32(2, dtypes + c) &&
         std::strcmp(dtypes[c + 2], "int32") == 0 && shapes[c + 2][0] == shapes[c][0] &&
         shapes[c + 2][1] == shapes[c][1] && shapes[c + 2][2] == 1 && shapes[c + 2][3] == 3;
}

// The step's position: the last entry of the first (row, head, position) triple of the index
int64_t step_position(void *index) { return static_cast<const int32_t *>(index)[2]; }

// A decoding step's self attention in one launch instead of a split, two scatters, a
// scale, two batched products, a mask and a softmax (`attend_step`, H = G). inputs: qkv
// (B, 1, 3 H D) laid out head by head, cache_key and cache_value (B, H, L, D), written in
// place, index int32 (B, H, 1, 3) (`cache_index`: the position is its last entry);
// outputs: context (B, 1, H D).
extern "C" int DecodeAttention(AOT_ARGS) {
  Clocked clocked("DecodeAttention");
  if (nparam != 5 || ndims[0] != 3 || ndims[4] != 3 || !all_float32(1, dtypes) ||
      !all_float32(1, dtypes + 4) || !cache_inputs(1, ndims, shapes, dtypes)) {
    return 1;
  }
  const int64_t batch = shapes[1][0], heads = shapes[1][1], depth = shapes[1][3];
  if (shapes[0][0] != batch || shapes[0][1] != 1 || shapes[0][2] != 3 * heads * depth ||
      shapes[4][0] != batch || shapes[4][1] != 1 || shapes[4][2] != heads * depth) {
    return 1;
  }
  const float *qkv = as_float(params[0]);
  const StepAttention a{qkv, 3 * heads * depth, 3 * depth, qkv + depth, 3 * heads * depth,
                        3 * depth, as_float(params[1]), as_float(params[2]),
                        as_float(params[4]), batch, heads, heads, shapes[1][2], depth};
  return attend_step(a, step_position(params[3])) ? 0 : 1;
}

// Decoding blocks: one launch for each half of a pre-norm decoder block at a decoding
// step's few rows (B <= SKINNY_ROWS), y = x + f(norm(x)), where MindSpore's executor would
// run five to eight launches (norm, products, attention or activation, residual addition).
// x and y are (B, 1, W); the scratch vectors hold the few rows between the parts.

// Whether inputs [first, first + count) are float32 vectors of `size` floats
bool vectors_of(int first, int count, int64_t size, int *ndims, int64_t **shapes,
                const char **dtypes) {
  for (int i = first; i < first + count; ++i) {
    if (ndims[i] != 1 || shapes[i][0] != size || !all_float32(1, dtypes + i)) return false;
  }
  return true;
}

// Whether input i is a float32 matrix (rows, columns)
bool matrix_of(int i, int64_t rows, int64_t columns, int *ndims, int64_t **shapes,
               const char **dtypes) {
  return ndims[i] == 2 && shapes[i][0] == rows && shapes[i][1] == columns &&
         all_float32(1, dtypes + i);
}

// A decoding block's norm of its B rows x (input 0, (B, 1, W)) into y (B, W): LayerNorm
// with gamma, beta, eps as inputs 1-3, or RMSNorm with weight, eps as inputs 1-2
void layer_norm_step(void **params, int64_t batch, int64_t width, float *y) {
  const float *x = as_float(params[0]);
  for (int64_t b = 0; b < batch; ++b) {
    float mean, rstd;
    layer_norm_row(x + b * width, as_float(params[1]), as_float(params[2]), *as_float(params[3]),
                   width, y + b * width, &mean, &rstd);
  }
}

void rms_norm_step(void **params, int64_t batch, int64_t width, float *y) {
  const float *x = as_float(params[0]);
  for (int64_t b = 0; b < batch; ++b) {
    rms_norm_row(x + b * width, as_float(params[1]), *as_float(params[2]), width, y + b * width);
  }
}

constexpr int64_t kFewRows = 16;   // the most rows of a decoding block (SKINNY_ROWS)

// Whether input i and the output (the last parameter) are float32 (B, 1, W), B <= kFewRows
bool step_rows(int i, int nparam, int *ndims, int64_t **shapes, const char **dtypes) {
  return ndims[i] == 3 && shapes[i][1] == 1 && shapes[i][0] >= 1 && shapes[i][0] <= kFewRows &&
         ndims[nparam - 1] == 3 &&
         std::memcmp(shapes[i], shapes[nparam - 1], 3 * sizeof(int64_t)) == 0 &&
         all_float32(1, dtypes + i) && all_float32(1, dtypes + nparam - 1);
}

// Self attention's half of a pre-LayerNorm block (GPT-2): x + out(attention(qkv(LN(x)))),
// the newest keys and values written into the caches in place (`attend_step`, H = G).
// inputs: x (B, 1, W), gamma, beta (W), eps (scalar), w_qkv (3 H D, W) laid out head by
// head, b_qkv (3 H D), w_out (W, H D), b_out (W), cache_key, cache_value (B, H, L, D),
// index int32 (B, H, 1, 3); outputs: y (B, 1, W)
extern "C" int DecodeAttentionBlock(AOT_ARGS) {
  Clocked clocked("DecodeAttentionBlock");
  if (nparam != 12 || !step_rows(0, nparam, ndims, shapes, dtypes) ||
      !cache_inputs(8, ndims, shapes, dtypes) || !all_float32(1, dtypes + 3)) {
    return 1;
  }
  const int64_t batch = shapes[0][0], width = shapes[0][2], heads = shapes[8][1],
                depth = shapes[8][3], inner = heads * depth;
  if (shapes[8][0] != batch || !vectors_of(1, 2, width, ndims, shapes, dtypes) ||
      !matrix_of(4, 3 * inner, width, ndims, shapes, dtypes) ||
      !vectors_of(5, 1, 3 * inner, ndims, shapes, dtypes) ||
      !matrix_of(6, width, inner, ndims, shapes, dtypes) ||
      !vectors_of(7, 1, width, ndims, shapes, dtypes)) {
    return 1;
  }
  const float *x = as_float(params[0]);
  std::vector<float> scratch(batch * (width + 4 * inner));
  float *normed = scratch.data(), *qkv = normed + batch * width, *context = qkv + 3 * batch * inner;
  layer_norm_step(params, batch, width, normed);
  few_rows_product(normed, as_float(params[4]), as_float(params[5]), nullptr, qkv, batch,
                   3 * inner, width);
  const StepAttention a{qkv, 3 * inner, 3 * depth, qkv + depth, 3 * inner, 3 * depth,
                        as_float(params[8]), as_float(params[9]), context, batch, heads, heads,
                        shapes[8][2], depth};
  if (!attend_step(a, step_position(params[10]))) return 1;
  few_rows_product(context, as_float(params[6]), as_float(params[7]), x, as_float(params[11]),
                   batch, width, inner);
  return 0;
}

// One rotary rotation in place (the half-split layout of `rotary`): v's D features by the
// position's cos and sin rows
inline void rotate_in_place(float *v, const float *cosine, const float *sine, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float first = v[i], second = v[i + half];
    v[i] = first * cosine[i] - second * sine[i];
    v[i + half] = second * cosine[i + half] + first * sine[i + half];
  }
}

// Grouped-query attention's half of a pre-RMSNorm block with rotary positions (LLaMA):
// x + out(attention(rotary(q(n)), rotary(k(n)), v(n))), n = RMSNorm(x), the newest keys and
// values written into the caches in place (`attend_step`).
// inputs: x (B, 1, W), weight (W), eps (scalar), w_q (H D, W), [b_q (H D)], w_kv (G 2 D, W)
// laid out key/value head by head, [b_kv (G 2 D)], w_out (W, H D), cos, sin (1, D) (the
// position's rows of the rotary tables), cache_key, cache_value (B, G, L, D), index int32
// (B, G, 1, 3); outputs: y (B, 1, W). The two biases come together or not at all.
extern "C" int DecodeGroupedAttentionBlock(AOT_ARGS) {
  Clocked clocked("DecodeGroupedAttentionBlock");
  const bool biased = nparam == 14;
  if ((nparam != 12 && !biased) || !step_rows(0, nparam, ndims, shapes, dtypes) ||
      !all_float32(1, dtypes + 2) || ndims[3] != 2) {
    return 1;
  }
  const int w_kv = biased ? 5 : 4, w_out = w_kv + (biased ? 2 : 1), cos_at = w_out + 1,
            caches = cos_at + 2;
  if (!cache_inputs(caches, ndims, shapes, dtypes)) return 1;
  const int64_t batch = shapes[0][0], width = shapes[0][2], groups = shapes[caches][1],
                depth = shapes[caches][3], q_width = shapes[3][0], kv_width = 2 * groups * depth;
  const int64_t heads = q_width / depth;
  if (shapes[caches][0] != batch || depth % 2 || q_width % depth || heads % groups ||
      !vectors_of(1, 1, width, ndims, shapes, dtypes) ||
      !matrix_of(3, q_width, width, ndims, shapes, dtypes) ||
      !matrix_of(w_kv, kv_width, width, ndims, shapes, dtypes) ||
      (biased && (!vectors_of(4, 1, q_width, ndims, shapes, dtypes) ||
                  !vectors_of(w_kv + 1, 1, kv_width, ndims, shapes, dtypes))) ||
      !matrix_of(w_out, width, q_width, ndims, shapes, dtypes) ||
      !matrix_of(cos_at, 1, depth, ndims, shapes, dtypes) ||
      !matrix_of(cos_at + 1, 1, depth, ndims, shapes, dtypes)) {
    return 1;
  }
  const float *x = as_float(params[0]);
  std::vector<float> scratch(batch * (width + 2 * q_width + kv_width));
  float *normed = scratch.data(), *q = normed + batch * width, *kv = q + batch * q_width,
        *context = kv + batch * kv_width;
  rms_norm_step(params, batch, width, normed);
  few_rows_product(normed, as_float(params[3]), biased ? as_float(params[4]) : nullptr, nullptr,
                   q, batch, q_width, width);
  few_rows_product(normed, as_float(params[w_kv]), biased ? as_float(params[w_kv + 1]) : nullptr,
                   nullptr, kv, batch, kv_width, width);
  const float *cosine = as_float(params[cos_at]), *sine = as_float(params[cos_at + 1]);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) rotate_in_place(q + b * q_width + h * depth, cosine, sine, depth);
    for (int64_t g = 0; g < groups; ++g) {
      rotate_in_place(kv + b * kv_width + 2 * g * depth, cosine, sine, depth);
    }
  }
  const StepAttention a{q, q_width, depth, kv, kv_width, 2 * depth, as_float(params[caches]),
                        as_float(params[caches + 1]), context, batch, heads, groups,
                        shapes[caches][2], depth};
  if (!attend_step(a, step_position(params[caches + 2]))) return 1;
  few_rows_product(context, as_float(params[w_out]), nullptr, x, as_float(params[nparam - 1]),
                   batch, width, q_width);
  return 0;
}

// The feed-forward half of a pre-LayerNorm block (GPT-2): x + proj(gelu(fc(LN(x)))), GELU's
// tanh form. inputs: x (B, 1, W), gamma, beta (W), eps (scalar), w_fc (F, W), b_fc (F),
// w_proj (W, F), b_proj (W); outputs: y (B, 1, W)
extern "C" int DecodeFeedForwardBlock(AOT_ARGS) {
  Clocked clocked("DecodeFeedForwardBlock");
  if (nparam != 9 || !step_rows(0, nparam, ndims, shapes, dtypes) ||
      !all_float32(1, dtypes + 3) || ndims[4] != 2) {
    return 1;
  }
  const int64_t batch = shapes[0][0], width = shapes[0][2], inner = shapes[4][0];
  if (!vectors_of(1, 2, width, ndims, shapes, dtypes) ||
      !matrix_of(4, inner, width, ndims, shapes, dtypes) ||
      !vectors_of(5, 1, inner, ndims, shapes, dtypes) ||
      !matrix_of(6, width, inner, ndims, shapes, dtypes) ||
      !vectors_of(7, 1, width, ndims, shapes, dtypes)) {
    return 1;
  }
  const float *x = as_float(params[0]);
  std::vector<float> scratch(batch * (width + inner));
  float *normed = scratch.data(), *hidden = normed + batch * width;
  layer_norm_step(params, batch, width, normed);
  few_rows_product(normed, as_float(params[4]), as_float(params[5]), nullptr, hidden, batch,
                   inner, width);
#pragma omp simd
  for (int64_t i = 0; i < batch * inner; ++i) hidden[i] = gelu_tanh(hidden[i]);
  few_rows_product(hidden, as_float(params[6]), as_float(params[7]), x, as_float(params[8]),
                   batch, width, inner);
  return 0;
}

// The feed-forward half of a pre-RMSNorm block (LLaMA): x + down(silu(g) u) for
// [g_0, u_0, g_1, u_1, ...] = gate_up(RMSNorm(x)). inputs: x (B, 1, W), weight (W), eps
// (scalar), w_gate_up (2 F, W) interleaved, w_down (W, F); outputs: y (B, 1, W)
extern "C" int DecodeGatedFeedForwardBlock(AOT_ARGS) {
  Clocked clocked("DecodeGatedFeedForwardBlock");
  if (nparam != 6 || !step_rows(0, nparam, ndims, shapes, dtypes) ||
      !all_float32(1, dtypes + 2) || ndims[3] != 2) {
    return 1;
  }
  const int64_t batch = shapes[0][0], width = shapes[0][2], inner = shapes[3][0] / 2;
  if (!vectors_of(1, 1, width, ndims, shapes, dtypes) ||
      !matrix_of(3, 2 * inner, width, ndims, shapes, dtypes) ||
      !matrix_of(4, width, inner, ndims, shapes, dtypes)) {
    return 1;
  }
  const float *x = as_float(params[0]);
  std::vector<float> scratch(batch * (width + 3 * inner));
  float *normed = scratch.data(), *pairs = normed + batch * width, *gated = pairs + 2 * batch * inner;
  rms_norm_step(params, batch, width, normed);
  few_rows_product(normed, as_float(params[3]), nullptr, nullptr, pairs, batch, 2 * inner, width);
#pragma omp simd
  for (int64_t i = 0; i < batch * inner; ++i) {
    const float g = pairs[2 * i], u = pairs[2 * i + 1];
    gated[i] = g * sigmoid_approx(g) * u;
  }
  few_rows_product(gated, as_float(params[4]), nullptr, x, as_float(params[5]), batch, width,
                   inner);
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
  if (elements(ndims[1], shapes[1]) != columns) return 1;
  parallel_for(rows, row_grain(columns), [=](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const float *xr = x + r * columns;
      float *yr = y + r * columns;
#pragma omp simd
      for (int64_t c = 0; c < columns; ++c) yr[c] = xr[c] + bias[c];
    }
  });
  return 0;
}

// z = x + y for two tensors of one size. inputs: x, y; outputs: z
extern "C" int AddForward(AOT_ARGS) {
  Clocked clocked("AddForward");
  if (nparam != 3 || !all_float32(nparam, dtypes)) return 1;
  const int64_t count = elements(ndims[0], shapes[0]);
  if (elements(ndims[1], shapes[1]) != count) return 1;
  const float *x = as_float(params[0]), *y = as_float(params[1]);
  float *z = as_float(params[2]);
  parallel_for(count, 1 << 15, [=](int64_t begin, int64_t end, int) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) z[i] = x[i] + y[i];
  });
  return 0;
}

// The bias gradient: dy summed over every axis but the last. inputs: dy (..., C); outputs: (C)
extern "C" int ColumnSum(AOT_ARGS) {
  if (nparam != 2 || !all_float32(nparam, dtypes)) return 1;
  column_sums(as_float(params[0]), rows_of(ndims[0], shapes[0]), shapes[0][ndims[0] - 1],
              as_float(params[1]));
  return 0;
}

// inputs: x, key int32 (4), keep float32 (1); outputs: y = x * mask / keep. The backward
// takes dy in place of x and gives dx the same way.
extern "C" int KeyedDropout(AOT_ARGS) {
  if (nparam != 4 || !all_float32(1, dtypes) || std::strcmp(dtypes[1], "int32") != 0 ||
      shapes[1][0] != 4) {
    return 1;
  }
  const float *x = as_float(params[0]);
  const KeyedMask mask(static_cast<const int32_t *>(params[1]), *as_float(params[2]));
  float *y = as_float(params[3]);
  parallel_for(elements(ndims[0], shapes[0]), 1 << 15, [=](int64_t begin, int64_t end, int) {
    mask.apply(x + begin, y + begin, begin, end - begin);
  });
  return 0;
}

// AdamW over all parameters in one call, in place (MindSpore's AdamWeightDecay, whose CPU
// kernel makes one launch per parameter): for each element, with g = grad * factor (the
// train step's unscaling and clipping, folded in here to save a pass over the gradients),
//   m += (g - m) (1 - beta1);  v += (g^2 - v) (1 - beta2)
//   p -= lr (m / (sqrt(v) + eps) + decay p)
// inputs: lr (1), factor (1), apply (1), constants (3: beta1, beta2, eps), decays (T: each
// parameter's weight decay), then T parameters, their T first moments, T second moments and
// T gradients, all float32; outputs: a (1) placeholder holding 0. The parameters and moments
// are written in place (the operator is marked as writing memory), unless apply is 0 (a
// step whose gradients are not finite: skipped here rather than by a branch of the graph,
// which costs MindSpore about 1 ms a step on CPU). The elements are split over the usable
// cores: the update is bound by memory bandwidth, which one core cannot fill.
extern "C" int AdamWUpdate(AOT_ARGS) {
  if (nparam < 10 || (nparam - 6) % 4 != 0 || !all_float32(nparam, dtypes)) return 1;
  const int tensors = (nparam - 6) / 4;
  if (elements(ndims[4], shapes[4]) != tensors) return 1;
  for (int t = 0; t < tensors; ++t) {
    const int64_t count = elements(ndims[5 + t], shapes[5 + t]);
    for (int part = 1; part < 4; ++part) {
      if (elements(ndims[5 + part * tensors + t], shapes[5 + part * tensors + t]) != count) {
        return 1;
      }
    }
  }
  *as_float(params[nparam - 1]) = 0.f;
  if (*as_float(params[2]) == 0.f) return 0;
  const float lr = *as_float(params[0]), factor = *as_float(params[1]);
  const float *constants = as_float(params[3]), *decays = as_float(params[4]);
  const float keep_m = 1.f - constants[0], keep_v = 1.f - constants[1], eps = constants[2];
  std::vector<int64_t> starts(tensors + 1, 0);   // element offsets of the tensors, end to end
  for (int t = 0; t < tensors; ++t) {
    starts[t + 1] = starts[t] + elements(ndims[5 + t], shapes[5 + t]);
  }
  const int64_t total = starts[tensors];
  const int64_t *offsets = starts.data();
  parallel_for(total, 1 << 16, [=](int64_t begin, int64_t end, int) {
    for (int t = 0; t < tensors; ++t) {
      const int64_t from = std::max(begin, offsets[t]) - offsets[t];
      const int64_t to = std::min(end, offsets[t + 1]) - offsets[t];
      if (from >= to) continue;
      float *p = as_float(params[5 + t]), *m = as_float(params[5 + tensors + t]);
      float *v = as_float(params[5 + 2 * tensors + t]);
      const float *g = as_float(params[5 + 3 * tensors + t]);
      const float decay = decays[t];
#pragma omp simd
      for (int64_t i = from; i < to; ++i) {
        const float grad = g[i] * factor;
        const float m_i = m[i] + (grad - m[i]) * keep_m;
        const float v_i = v[i] + (grad * grad - v[i]) * keep_v;
        m[i] = m_i;
        v[i] = v_i;
        p[i] -= lr * (m_i / (std::sqrt(v_i) + eps) + decay * p[i]);
      }
    }
  });
  return 0;
}
