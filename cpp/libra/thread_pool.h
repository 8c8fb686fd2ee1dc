// Engine-owned thread pools.
//
// XLA:CPU continues a device's program on whichever thread completes that
// device's future, and its own intra-op pool is sized for compute, not for
// waiting. The engine therefore owns its threads: one pool runs the reduction
// tasks (the CPU counterpart of CUDA thread blocks), another completes futures.
//
// Pools are process-lifetime singletons that are never destroyed (XLA threads
// may still call in while static destructors run at interpreter exit), and
// they are rebuilt empty in the child after fork(): the parent's threads do
// not exist there.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

namespace libra {

// Called in the child after fork(): drops the parent's (absent) threads.
void ResetPoolsAfterFork();

class ThreadPool {
 public:
  using Task = std::function<void()>;

  // A pool of at most `max_threads` threads, started on demand.
  ThreadPool(std::string name, int max_threads);

  // Runs `task` on a pool thread. A new thread starts whenever queued tasks
  // outnumber idle threads, so up to `max_threads` tasks run concurrently.
  void Schedule(Task task);

  // Threads started so far (idle or busy), not counting released ones.
  int num_threads() const;

  // Called inside a task of this pool, on its thread: the thread stops counting
  // against max_threads until the task returns, so the pool may start another
  // meanwhile. For a task that goes on to run callers' continuations, which may
  // take long (or wait on other devices' progress, which may need this pool).
  // When the task returns, the thread rejoins the pool if it has room, else it
  // ends. No effect on any other thread.
  void ReleaseCurrentThread();

  // Pool for reduction tasks: one task per block.
  static ThreadPool& Reduce();
  // Pool that completes callers' futures (and so runs XLA's continuations).
  static ThreadPool& Completion();

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;
    int threads = 0;
    int idle = 0;
  };
  static void WorkerLoop(std::shared_ptr<Shared> shared, std::string name, int max_threads);
  void ResetAfterFork();
  friend void ResetPoolsAfterFork();

  std::string name_;
  int max_threads_;
  std::shared_ptr<Shared> shared_;
};

// Storage for a process-lifetime object whose destructor never runs.
template <typename T>
class NoDestructor {
 public:
  template <typename... Args>
  explicit NoDestructor(Args&&... args) {
    new (&storage_) T(std::forward<Args>(args)...);
  }
  T& operator*() { return *reinterpret_cast<T*>(&storage_); }
  T* operator->() { return &**this; }

 private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

}  // namespace libra
