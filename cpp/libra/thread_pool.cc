#include "libra/thread_pool.h"

#include <pthread.h>

#include <system_error>
#include <thread>
#include <vector>

#include "libra/engine.h"

namespace libra {
namespace {

// Shared states abandoned in a fork child. Their mutexes may be held by
// threads that do not exist in the child, so they are kept, never destroyed.
std::vector<std::shared_ptr<void>>& Graveyard() {
  static NoDestructor<std::vector<std::shared_ptr<void>>> graveyard;
  return *graveyard;
}

void InstallForkHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, [] { ResetPoolsAfterFork(); });
  });
}

}  // namespace

ThreadPool::ThreadPool(std::string name, int max_threads)
    : name_(std::move(name)),
      max_threads_(max_threads),
      shared_(std::make_shared<Shared>()) {}

void ThreadPool::Schedule(Task task) {
  std::shared_ptr<Shared> shared = shared_;
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->queue.push_back(std::move(task));
  // Idle threads that have been notified but not yet woken still count as
  // idle, and their tasks are still queued: comparing the two is exact.
  if (static_cast<int>(shared->queue.size()) > shared->idle &&
      shared->threads < max_threads_) {
    try {
      std::thread(WorkerLoop, shared, name_, max_threads_).detach();
      ++shared->threads;
    } catch (const std::system_error&) {
      if (shared->threads == 0) {  // No thread can ever run it: run it here.
        Task inline_task = std::move(shared->queue.back());
        shared->queue.pop_back();
        lock.unlock();
        inline_task();
        return;
      }
    }
  }
  shared->cv.notify_one();
}

namespace {
// The pool state of the task running on this thread, and whether it released the thread.
thread_local void* current_shared = nullptr;
thread_local bool current_released = false;
}  // namespace

void ThreadPool::ReleaseCurrentThread() {
  if (current_shared != shared_.get() || current_released) return;
  std::lock_guard<std::mutex> lock(shared_->mu);
  --shared_->threads;
  current_released = true;
}

int ThreadPool::num_threads() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->threads;
}

void ThreadPool::WorkerLoop(std::shared_ptr<Shared> shared, std::string name, int max_threads) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  std::unique_lock<std::mutex> lock(shared->mu);
  for (;;) {
    while (shared->queue.empty()) {
      ++shared->idle;
      shared->cv.wait(lock);
      --shared->idle;
    }
    Task task = std::move(shared->queue.front());
    shared->queue.pop_front();
    lock.unlock();
    current_shared = shared.get();
    task();
    task = nullptr;  // Release captures before taking the lock again.
    current_shared = nullptr;
    lock.lock();
    if (current_released) {
      current_released = false;
      if (shared->threads >= max_threads) return;  // Replaced meanwhile: this one ends.
      ++shared->threads;
    }
  }
}

void ThreadPool::ResetAfterFork() {
  Graveyard().push_back(std::move(shared_));
  shared_ = std::make_shared<Shared>();
}

ThreadPool& ThreadPool::Reduce() {
  static NoDestructor<ThreadPool> pool("libra-reduce", kMaxBlocks);
  InstallForkHandler();
  return *pool;
}

ThreadPool& ThreadPool::Completion() {
  // Each waiting caller's continuation may run for long on its completing
  // thread, so this pool must not serialize callers: effectively unbounded.
  static NoDestructor<ThreadPool> pool("libra-complete", 4096);
  InstallForkHandler();
  return *pool;
}

void ResetPoolsAfterFork() {
  ThreadPool::Reduce().ResetAfterFork();
  ThreadPool::Completion().ResetAfterFork();
  ResetWatchdogAfterFork();
}

}  // namespace libra
