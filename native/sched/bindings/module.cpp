// pybind11 bindings of the scheduler core: `deepinfer_sched._core`.
//
// The hot path (schedule / update_from_output) crosses the boundary with one object and a few
// numpy arrays: step outputs expose their flat arrays as read-only numpy views that borrow the
// output's storage (the view keeps the output alive), and sampled tokens come in as one int32
// array. No Python object is created per token or per sequence on that path.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <stdexcept>

#include "deepinfer/block_allocator.hpp"
#include "deepinfer/scheduler.hpp"

namespace py = pybind11;
using namespace deepinfer;

namespace {

using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A read-only 1-D or 2-D numpy view of `data`, kept alive by `owner`.
template <typename T>
py::array view(const std::vector<T>& data, py::handle owner, py::ssize_t rows, py::ssize_t cols = -1) {
  std::vector<py::ssize_t> shape{rows}, strides{static_cast<py::ssize_t>(sizeof(T))};
  if (cols >= 0) {
    shape = {rows, cols};
    strides = {static_cast<py::ssize_t>(sizeof(T)) * cols, static_cast<py::ssize_t>(sizeof(T))};
  }
  static const T empty{};
  const T* ptr = data.empty() ? &empty : data.data();
  py::array arr(py::dtype::of<T>(), shape, strides, ptr, owner);
  py::detail::array_proxy(arr.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return arr;
}

template <typename T>
py::array copy_of(const std::vector<T>& data) {
  py::array_t<T> arr(static_cast<py::ssize_t>(data.size()));
  if (!data.empty()) std::memcpy(arr.mutable_data(), data.data(), sizeof(T) * data.size());
  return arr;
}

py::object reason_or_none(FinishReason r) {
  if (r == FinishReason::kNone) return py::none();
  return py::str(finish_reason_name(r));
}

py::list finished_list(const std::vector<FinishedSeq>& fin) {
  py::list out(fin.size());
  for (size_t i = 0; i < fin.size(); ++i) {
    out[i] = py::make_tuple(fin[i].seq_id, finish_reason_name(fin[i].reason));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "DeepInfer scheduler core (C++17)";

  m.def("build_info", [] {
    py::dict info;
    info["accelerator"] = DEEPINFER_ACCELERATOR_NAME;
    info["cxx_standard"] = __cplusplus;
#ifdef NDEBUG
    info["debug"] = false;
#else
    info["debug"] = true;
#endif
    return info;
  });
  m.def("monotonic_seconds", &monotonic_seconds,
        "The clock of all scheduler timestamps (CLOCK_MONOTONIC, same as time.monotonic()).");

  py::class_<BlockAllocator>(m, "BlockAllocator")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_used", &BlockAllocator::num_used)
      .def("allocate", &BlockAllocator::allocate)
      .def("incref", &BlockAllocator::incref, py::arg("block_id"))
      .def("decref", &BlockAllocator::decref, py::arg("block_id"), py::arg("to_head") = false)
      .def("ref_count", &BlockAllocator::ref_count, py::arg("block_id"))
      .def("free_list", &BlockAllocator::free_list);

  py::enum_<EngineType>(m, "EngineType")
      .value("NORMAL", EngineType::kNormal)
      .value("PROMPT", EngineType::kPrompt)
      .value("COMPLETION", EngineType::kCompletion);

  py::enum_<SeqStatus>(m, "SequenceStatus")
      .value("WAITING", SeqStatus::kWaiting)
      .value("RUNNING", SeqStatus::kRunning)
      .value("PREEMPTED", SeqStatus::kPreempted)
      .value("FINISHED", SeqStatus::kFinished);

  py::class_<SchedulerConfig>(m, "_NativeConfig")
      .def(py::init([](int32_t block_size, int32_t num_blocks, int32_t max_num_seqs, int32_t max_num_batched_tokens,
                       int32_t max_model_len, bool enable_prefix_caching, bool enable_chunked_prefill,
                       EngineType engine_type, int32_t num_speculative_tokens, int32_t prefix_hash_bits,
                       bool finish_preempted, bool report_evictions) {
             SchedulerConfig c;
             c.block_size = block_size;
             c.num_blocks = num_blocks;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.max_model_len = max_model_len;
             c.enable_prefix_caching = enable_prefix_caching;
             c.enable_chunked_prefill = enable_chunked_prefill;
             c.engine_type = engine_type;
             c.num_speculative_tokens = num_speculative_tokens;
             c.prefix_hash_bits = prefix_hash_bits;
             c.finish_preempted = finish_preempted;
             c.report_evictions = report_evictions;
             c.validate();
             return c;
           }),
           py::arg("block_size"), py::arg("num_blocks"), py::arg("max_num_seqs"), py::arg("max_num_batched_tokens"),
           py::arg("max_model_len"), py::arg("enable_prefix_caching"), py::arg("enable_chunked_prefill"),
           py::arg("engine_type"), py::arg("num_speculative_tokens"),
           py::arg("prefix_hash_bits") = 64, py::arg("finish_preempted") = false,
           py::arg("report_evictions") = false);

  py::class_<StepOutput, std::shared_ptr<StepOutput>>(m, "SchedulerOutput", R"doc(
One step's schedule. Array properties are read-only numpy views of this object's storage:
per sequence (n = num_seqs) and per query token (T = num_batched_tokens).)doc")
      .def_readonly("step_id", &StepOutput::step_id)
      .def_property_readonly("num_seqs", &StepOutput::num_seqs)
      .def("__len__", &StepOutput::num_seqs)
      .def_readonly("num_batched_tokens", &StepOutput::num_batched_tokens)
      .def_readonly("any_prefill", &StepOutput::any_prefill)
      .def_readonly("has_unknown_input_ids", &StepOutput::has_unknown_inputs)
      .def_readonly("max_num_blocks", &StepOutput::table_width)
      .def_property_readonly("is_empty", [](const StepOutput& o) { return o.entries.empty(); })
      .def_property_readonly("seq_ids", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.seq_ids, self, o.num_seqs());
      })
      .def_property_readonly("query_start_loc", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.query_start_loc, self, o.num_seqs() + 1);
      })
      .def_property_readonly("query_lens", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.query_lens, self, o.num_seqs());
      })
      .def_property_readonly("start_positions", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.start_positions, self, o.num_seqs());
      })
      .def_property_readonly("seq_lens", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.seq_lens, self, o.num_seqs());
      })
      .def_property_readonly("prompt_lens", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.prompt_lens, self, o.num_seqs());
      })
      .def_property_readonly("num_draft_tokens", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.num_drafts, self, o.num_seqs());
      })
      .def_property_readonly("is_prefill", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.is_prefill, self, o.num_seqs()).attr("view")("bool");
      })
      .def_property_readonly("emits_tokens", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.emits_tokens, self, o.num_seqs()).attr("view")("bool");
      })
      .def_property_readonly("prev_rows", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.prev_rows, self, o.num_seqs());
      })
      .def_property_readonly("positions", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.positions, self, o.num_batched_tokens);
      })
      .def_property_readonly("input_ids", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.input_ids, self, o.num_batched_tokens);
      })
      .def_property_readonly("slot_mapping", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.slot_mapping, self, o.num_batched_tokens);
      })
      .def_property_readonly("block_tables", [](py::object self) {
        auto& o = self.cast<const StepOutput&>();
        return view(o.block_tables, self, o.num_seqs(), o.table_width);
      })
      .def_property_readonly("logits_indices",
                             [](py::object self) {
                               auto& o = self.cast<const StepOutput&>();
                               return view(o.logits_indices, self, static_cast<py::ssize_t>(o.logits_indices.size()));
                             })
      .def_property_readonly("logits_lens",
                             [](py::object self) {
                               auto& o = self.cast<const StepOutput&>();
                               return view(o.logits_lens, self, o.num_seqs());
                             })
      .def_property_readonly("preempted_seq_ids", [](const StepOutput& o) { return copy_of(o.preempted_seq_ids); })
      .def_property_readonly("evicted_blocks", [](const StepOutput& o) {
        // (block_ids int32 [E], hashes uint64 [E], checks uint64 [E], tokens int32 [E, block_size])
        const size_t n = o.evicted.size();
        std::vector<int32_t> ids(n), toks;
        std::vector<uint64_t> hashes(n), checks(n);
        const size_t bs = n ? o.evicted[0].tokens.size() : 0;
        toks.reserve(n * bs);
        for (size_t i = 0; i < n; ++i) {
          ids[i] = o.evicted[i].block_id;
          hashes[i] = o.evicted[i].key.hash;
          checks[i] = o.evicted[i].key.check;
          toks.insert(toks.end(), o.evicted[i].tokens.begin(), o.evicted[i].tokens.end());
        }
        py::array tokens = copy_of(toks);
        return py::make_tuple(copy_of(ids), copy_of(hashes), copy_of(checks),
                              tokens.attr("reshape")(static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(bs)));
      })
      .def_property_readonly("block_loads", [](const StepOutput& o) {
        // (seq_ids int64 [L], indices int32 [L], block_ids int32 [L], hashes uint64 [L], checks uint64 [L])
        const size_t n = o.loads.size();
        std::vector<int64_t> seqs(n);
        std::vector<int32_t> idx(n), ids(n);
        std::vector<uint64_t> hashes(n), checks(n);
        for (size_t i = 0; i < n; ++i) {
          seqs[i] = o.loads[i].seq_id;
          idx[i] = o.loads[i].index;
          ids[i] = o.loads[i].block_id;
          hashes[i] = o.loads[i].key.hash;
          checks[i] = o.loads[i].key.check;
        }
        return py::make_tuple(copy_of(seqs), copy_of(idx), copy_of(ids), copy_of(hashes), copy_of(checks));
      })
      .def_property_readonly("has_tier_transfers",
                             [](const StepOutput& o) { return !o.evicted.empty() || !o.loads.empty(); })
      .def_property_readonly("scheduled_seqs", [](const StepOutput& o) {
        py::list out(o.entries.size());
        for (size_t i = 0; i < o.entries.size(); ++i) {
          const StepEntry& e = o.entries[i];
          out[i] = py::make_tuple(o.seq_ids[i], e.start, e.q, e.prefill, e.num_drafts);
        }
        return out;
      })
      .def("__repr__", [](const StepOutput& o) {
        return "SchedulerOutput(step_id=" + std::to_string(o.step_id) + ", num_seqs=" + std::to_string(o.num_seqs()) +
               ", num_batched_tokens=" + std::to_string(o.num_batched_tokens) +
               ", any_prefill=" + (o.any_prefill ? "True" : "False") + ")";
      });

  py::class_<Scheduler>(m, "_NativeScheduler")
      .def(py::init<const SchedulerConfig&>(), py::arg("config"))
      .def("_add_request",
           [](Scheduler& s, IntArray prompt, int64_t seq_id, int32_t max_tokens, int32_t min_tokens,
              const std::vector<int32_t>& stop_token_ids, int32_t eos_token_id, bool ignore_eos, int32_t priority,
              double arrival_time, std::optional<IntArray> cached_block_ids, uint64_t cache_salt) {
             if (prompt.ndim() != 1) throw std::invalid_argument("prompt_token_ids must be one-dimensional");
             RequestLimits l;
             l.max_tokens = max_tokens;
             l.min_tokens = min_tokens;
             l.stop_token_ids = stop_token_ids;
             l.eos_token_id = eos_token_id;
             l.ignore_eos = ignore_eos;
             const int32_t* blocks = nullptr;
             int32_t nb = 0;
             if (cached_block_ids) {
               blocks = cached_block_ids->data();
               nb = static_cast<int32_t>(cached_block_ids->size());
             }
             return s.add_request(seq_id, prompt.data(), static_cast<int32_t>(prompt.size()), l, priority,
                                  arrival_time, blocks, nb, cache_salt);
           },
           py::arg("prompt_token_ids"), py::arg("seq_id"), py::arg("max_tokens"), py::arg("min_tokens"),
           py::arg("stop_token_ids"), py::arg("eos_token_id"), py::arg("ignore_eos"), py::arg("priority"),
           py::arg("arrival_time"), py::arg("cached_block_ids"), py::arg("cache_salt") = 0)
      .def("abort", &Scheduler::abort, py::arg("seq_id"),
           "Abort a request at any time; frees its blocks. Returns False if it had already finished.")
      .def("requeue", &Scheduler::requeue, py::arg("seq_id"), py::arg("sched_output"),
           "Send a running sequence of the latest unprocessed step back to waiting (it recomputes, as after "
           "a preemption; reconcile drops its entry). False where a preempted sequence would finish instead.")
      .def("release", &Scheduler::release, py::arg("seq_id"),
           "Forget a finished request (a PROMPT engine's held blocks are freed here).")
      .def(
          "set_draft_tokens",
          [](Scheduler& s, int64_t seq_id, IntArray tokens) {
            s.set_draft_tokens(seq_id, tokens.data(), static_cast<int32_t>(tokens.size()));
          },
          py::arg("seq_id"), py::arg("draft_token_ids"))
      .def("schedule", &Scheduler::schedule)
      .def(
          "_update",
          [](Scheduler& s, const StepOutput& out, IntArray sampled, std::optional<IntArray> counts) {
            if (counts) {
              return finished_list(s.update_from_output(out, sampled.data(), counts->data(),
                                                        static_cast<int32_t>(counts->size()), sampled.size()));
            }
            static thread_local std::vector<int32_t> ones;
            if (ones.size() < static_cast<size_t>(sampled.size())) ones.assign(sampled.size(), 1);
            return finished_list(s.update_from_output(out, sampled.data(), ones.data(),
                                                      static_cast<int32_t>(sampled.size()), sampled.size()));
          },
          py::arg("sched_output"), py::arg("sampled"), py::arg("counts"))
      .def("reconcile", &Scheduler::reconcile, py::arg("sched_output"))
      .def(
          "add_loadable",
          [](Scheduler& s, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> hashes,
             py::array_t<uint64_t, py::array::c_style | py::array::forcecast> checks) {
            if (hashes.size() != checks.size()) throw std::invalid_argument("hashes and checks must have one length");
            for (py::ssize_t i = 0; i < hashes.size(); ++i) s.add_loadable(BlockKey{hashes.data()[i], checks.data()[i]});
          },
          py::arg("hashes"), py::arg("checks"),
          "Keys (hash, check) a lower KV tier now holds: prefix hits there are loaded, not computed.")
      .def(
          "drop_loadable",
          [](Scheduler& s, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> hashes,
             py::array_t<uint64_t, py::array::c_style | py::array::forcecast> checks) {
            if (hashes.size() != checks.size()) throw std::invalid_argument("hashes and checks must have one length");
            for (py::ssize_t i = 0; i < hashes.size(); ++i) s.drop_loadable(BlockKey{hashes.data()[i], checks.data()[i]});
          },
          py::arg("hashes"), py::arg("checks"), "Keys the lower tier no longer holds.")
      .def_property_readonly("num_loadable", &Scheduler::num_loadable)
      .def(
          "uncache_block",
          [](Scheduler& s, int32_t block_id) { s.uncache_block(block_id); }, py::arg("block_id"),
          "Forget a block's cached content (a lower-tier load that failed): no request hits it again.")
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_unfinished", &Scheduler::num_unfinished)
      .def_property_readonly("num_inflight_steps", &Scheduler::num_inflight_steps)
      .def("waiting_ids", &Scheduler::waiting_ids)
      .def("running_ids", &Scheduler::running_ids)
      .def("live_ids", &Scheduler::live_ids)
      .def("check_invariants", &Scheduler::check_invariants)
      // Per-sequence accessors.
      .def("token_ids", [](const Scheduler& s, int64_t id) { return copy_of(s.get(id).tokens); }, py::arg("seq_id"))
      .def(
          "output_token_ids",
          [](const Scheduler& s, int64_t id) {
            const Sequence& q = s.get(id);
            std::vector<int32_t> out(q.tokens.begin() + q.num_prompt_tokens, q.tokens.end());
            return copy_of(out);
          },
          py::arg("seq_id"))
      .def("num_prompt_tokens", [](const Scheduler& s, int64_t id) { return s.get(id).num_prompt_tokens; },
           py::arg("seq_id"))
      .def("status", [](const Scheduler& s, int64_t id) { return s.get(id).status; }, py::arg("seq_id"))
      .def("finish_reason", [](const Scheduler& s, int64_t id) { return reason_or_none(s.get(id).finish_reason); },
           py::arg("seq_id"))
      .def(
          "stop_token_id",
          [](const Scheduler& s, int64_t id) -> py::object {
            int32_t t = s.get(id).stop_token_id;
            if (t < 0) return py::none();
            return py::int_(t);
          },
          py::arg("seq_id"))
      .def("num_computed_tokens", [](const Scheduler& s, int64_t id) { return s.get(id).num_computed; },
           py::arg("seq_id"))
      .def("num_cached_tokens", [](const Scheduler& s, int64_t id) { return s.get(id).num_cached_tokens; },
           py::arg("seq_id"))
      .def("num_loaded_tokens", [](const Scheduler& s, int64_t id) { return s.get(id).num_loaded_tokens; },
           py::arg("seq_id"))
      .def("num_preemptions", [](const Scheduler& s, int64_t id) { return s.get(id).num_preemptions; },
           py::arg("seq_id"))
      .def("block_table", [](const Scheduler& s, int64_t id) { return copy_of(s.get(id).block_table); },
           py::arg("seq_id"))
      .def("draft_token_ids", [](const Scheduler& s, int64_t id) { return copy_of(s.get(id).draft_tokens); },
           py::arg("seq_id"))
      .def(
          "timestamps",
          [](const Scheduler& s, int64_t id) {
            const Sequence& q = s.get(id);
            auto t = [](double v) -> py::object {
              if (v < 0) return py::none();
              return py::float_(v);
            };
            py::dict d;
            d["arrival"] = q.arrival_time;
            d["first_scheduled"] = t(q.first_scheduled_time);
            d["first_token"] = t(q.first_token_time);
            d["finished"] = t(q.finished_time);
            return d;
          },
          py::arg("seq_id"))
      // Block manager views (tests, metrics).
      .def("block_ref_counts",
           [](const Scheduler& s) {
             const BlockManager& bm = s.block_manager();
             std::vector<int32_t> rc(bm.num_blocks());
             for (int32_t b = 0; b < bm.num_blocks(); ++b) rc[b] = bm.ref_count(b);
             return copy_of(rc);
           })
      .def("free_block_ids", [](const Scheduler& s) { return copy_of(s.block_manager().free_list()); })
      .def("is_block_cached", [](const Scheduler& s, int32_t b) { return s.block_manager().is_cached(b); },
           py::arg("block_id"))
      .def("stats", [](const Scheduler& s) {
        SchedulerStats st = s.stats();
        py::dict d;
        d["num_waiting"] = st.num_waiting;
        d["num_running"] = st.num_running;
        d["num_blocks"] = st.num_blocks;
        d["num_free_blocks"] = st.num_free_blocks;
        d["num_cached_free_blocks"] = st.num_cached_free_blocks;
        d["kv_usage"] = st.num_blocks ? 1.0 - static_cast<double>(st.num_free_blocks) / st.num_blocks : 0.0;
        d["prefix_cache_query_tokens"] = st.prefix_query_tokens;
        d["prefix_cache_hit_tokens"] = st.prefix_hit_tokens;
        d["prefix_cache_hit_rate"] =
            st.prefix_query_tokens ? static_cast<double>(st.prefix_hit_tokens) / st.prefix_query_tokens : 0.0;
        d["tier_hit_tokens"] = st.tier_hit_tokens;
        d["num_evicted_blocks"] = st.num_evicted_blocks;
        d["num_preemptions"] = st.num_preemptions;
        d["num_steps"] = st.num_steps;
        d["num_finished"] = st.num_finished;
        d["num_aborted"] = st.num_aborted;
        d["last_step_num_seqs"] = st.last_num_seqs;
        d["last_step_num_batched_tokens"] = st.last_num_batched_tokens;
        d["last_step_num_prefill_tokens"] = st.last_num_prefill_tokens;
        return d;
      });
}
