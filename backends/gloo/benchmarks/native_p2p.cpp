// A measurement aid for p2p_components.py --native: pg-gloo's eager message format with no
// Python between the Gloo calls. Not part of pg-gloo.
//
// send_eager: a buffer of the 16-byte header (size, dtype code) and a copy of the payload,
// posted with Gloo's send; the work is kept, not waited for (drain() waits for them later),
// as an eager send's is. recv_eager: Gloo's receive into a first buffer of pg-gloo's size,
// waited for by one native thread while the caller waits on a condition variable in 100 ms
// slices (checking for signals between them, without the GIL while it waits), then the
// header checked and the payload copied out: pg-gloo's receive, in C++.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

namespace {

constexpr int64_t kHeader = 16;
constexpr int64_t kFirst = kHeader + (2 << 20);

class Waiter {
 public:
  Waiter() : thread_([this] { run(); }) {}
  ~Waiter() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stop_ = true;
    }
    to_thread_.notify_one();
    thread_.join();
  }

  void start(WorkPtr work) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      item_ = std::move(work);
      done_ = false;
    }
    to_thread_.notify_one();
  }

  bool wait_for(int ms) {
    std::unique_lock<std::mutex> lock(mutex_);
    return to_caller_.wait_for(lock, std::chrono::milliseconds(ms), [this] { return done_; });
  }

  const std::string& error() const { return error_; }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      to_thread_.wait(lock, [this] { return item_ || stop_; });
      if (stop_) {
        return;
      }
      WorkPtr work = std::move(item_);
      lock.unlock();
      std::string error;
      try {
        work->wait();
      } catch (const std::exception& exc) {
        error = exc.what();
      }
      work.reset();
      lock.lock();
      error_ = error;
      done_ = true;
      to_caller_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable to_thread_, to_caller_;
  WorkPtr item_;
  bool done_ = false, stop_ = false;
  std::string error_;
  std::thread thread_;
};

class Native {
 public:
  explicit Native(c10::intrusive_ptr<c10d::Backend> pg)
      : pg_(std::move(pg)), first_(at::empty({kFirst}, at::kByte)) {}

  void send_eager(const at::Tensor& tensor, int dst, int tag, int64_t code) {
    const int64_t nbytes = tensor.numel() * tensor.element_size();
    at::Tensor message = at::empty({kHeader + nbytes}, at::kByte);
    auto* out = static_cast<uint8_t*>(message.data_ptr());
    const int64_t header[2] = {nbytes, code};
    std::memcpy(out, header, kHeader);
    std::memcpy(out + kHeader, tensor.data_ptr(), nbytes);
    std::vector<at::Tensor> tensors{message};
    WorkPtr work;
    {
      py::gil_scoped_release nogil;
      work = pg_->send(tensors, dst, tag);
    }
    sends_.emplace_back(std::move(work), std::move(message));
  }

  void recv_eager(at::Tensor& tensor, int src, int tag, int64_t code) {
    const int64_t want = tensor.numel() * tensor.element_size();
    std::vector<at::Tensor> tensors{first_};
    {
      py::gil_scoped_release nogil;
      waiter_.start(pg_->recv(tensors, src, tag));
    }
    while (true) {
      bool done;
      {
        py::gil_scoped_release nogil;
        done = waiter_.wait_for(100);
      }
      if (done) {
        break;
      }
      if (PyErr_CheckSignals() != 0) {
        throw py::error_already_set();
      }
    }
    if (!waiter_.error().empty()) {
      throw std::runtime_error(waiter_.error());
    }
    const auto* in = static_cast<const uint8_t*>(first_.data_ptr());
    int64_t header[2];
    std::memcpy(header, in, kHeader);
    if (header[0] != want || header[1] != code) {
      throw std::runtime_error("the message is not the receiving tensor's size and dtype");
    }
    std::memcpy(tensor.data_ptr(), in + kHeader, want);
  }

  void drain() {
    py::gil_scoped_release nogil;
    while (!sends_.empty()) {
      sends_.front().first->wait();
      sends_.pop_front();
    }
  }

 private:
  c10::intrusive_ptr<c10d::Backend> pg_;
  at::Tensor first_;
  Waiter waiter_;
  std::deque<std::pair<WorkPtr, at::Tensor>> sends_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Native>(m, "Native")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>())
      .def("send_eager", &Native::send_eager)
      .def("recv_eager", &Native::recv_eager)
      .def("drain", &Native::drain);
}
