// pipeplan execute PLAN [--backend cpu|cuda] [--local-ranks N] [--rank R --world N] [--nccl]
//                       [--rendezvous DIR [--rendezvous-key K]] [--check] [--trace FILE]
//                       [--timeout S] [--fault R [--fault-kill]]
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <memory>

#include "apps/common.h"
#include "core/chrome_trace.h"
#include "core/files.h"
#include "core/table_io.h"
#include "executor/check.h"
#include "planner/validate.h"

#ifdef PIPEPLAN_HAS_CUDA
#include "executor/cuda_backend.h"
#endif
#ifdef PIPEPLAN_HAS_MPI
#include "executor/mpi_run.h"
#endif
#ifdef PIPEPLAN_HAS_NCCL
#include "executor/nccl_backend.h"
#include "executor/rendezvous.h"
#endif

namespace pipeplan {
namespace {

// What FP8 storage of saved activations did to the gradients (the check itself compares
// with a reference that stores them the same way).
void PrintFp8Effect(const CheckResult& c) {
  if (!c.fp8_storage) return;
  fmt::print(
      "check: saved activations stored in FP8 (E4M3, an fp32 scale per 1x128 block), as in the "
      "reference; against unquantised storage the gradients differ by {:.3g} (relative)\n",
      c.fp8_effect);
}

StatusOr<CheckResult> RunCuda(const Table& t, const RunOptions& o, Timeline* measured) {
#ifdef PIPEPLAN_HAS_CUDA
  ASSIGN_OR_RETURN(auto backends, MakeCudaBackends(t));
  RETURN_IF_ERROR(RunLocal(t, backends, o, measured));
  return CheckResult{};
#else
  (void)t, (void)o, (void)measured;
  return Internal(
      "--backend cuda: this pipeplan was built without CUDA (no nvcc found at build time)");
#endif
}

// Rank and world size: --rank and --world when given (-1 = not), else Slurm's or Open
// MPI's, else process 0 of 1.
StatusOr<std::pair<int, int>> LaunchRank(int rank, int world) {
  if ((rank >= 0) != (world >= 0)) return InvalidInput("--rank and --world are given together");
  if (world >= 0) {
    if (world < 1 || rank >= world)
      return InvalidInput(
          fmt::format("--rank {} --world {}: expected 0 <= rank < world", rank, world));
    return std::pair{rank, world};
  }
  for (auto [r, w] : {std::pair{"SLURM_PROCID", "SLURM_NTASKS"},
                      std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}})
    if (const char* rv = std::getenv(r); rv && std::getenv(w))
      return std::pair{std::atoi(rv), std::atoi(std::getenv(w))};
  return std::pair{0, 1};
}

// The process's index among those on its node (selects its GPU).
[[maybe_unused]] int LocalRank(int rank) {
  for (const char* v : {"SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return rank;
}

struct ExecOptions {
  std::string plan, backend = "cpu", trace, rendezvous, rendezvous_key;
  int local_ranks = 0, rank = -1, world = -1;
  bool check = false, nccl = false;
  double timeout_s = 60;
  int fault_rank = -1;
  bool fault_kill = false;
};

Status WriteMeasuredTrace(const std::string& path, const Table& t, const Timeline& measured,
                          const char* source = "measured") {
  TraceOptions to;
  to.source = source;
  return WriteTrace(path, t, measured, {}, to);
}

// Writes this process's partial trace after a failure: TRACE.rank<r>.json (TRACE.gpu<p>.json
// where ranks hold several GPUs).
[[maybe_unused]] void WritePartialTrace(const std::string& trace, const Table& t,
                                        const Timeline& own, const std::string& name) {
  if (trace.empty() || own.start.size() != t.size()) return;
  (void)WriteMeasuredTrace(fmt::format("{}.{}.json", trace, name), t, own, "measured (partial)");
}

// One process per rank (srun / mpirun): MPI transport; rank 0 writes the merged trace and
// the check. Every rank exits non-zero when one fails.
int RunMultiProcess(const ExecOptions& o, const Table& t, int rank, int world) {
#ifdef PIPEPLAN_HAS_MPI
  (void)world;  // taken from MPI itself
  MpiAvailable();
  RunOptions ro;
  ro.op_timeout_s = o.timeout_s;
  ro.fault_rank = o.fault_rank;
  ro.fault_kill = o.fault_kill;
  // Each process journals its ops to TRACE.rank<r>.json as they end: if it is killed (the
  // launcher cancels the whole job when one process dies), that file is its partial trace.
  std::unique_ptr<TraceJournal> journal;
  if (!o.trace.empty()) {
    const int me = MpiRank();
    auto j = TraceJournal::Open(fmt::format("{}.rank{}.json", o.trace, me), t, me);
    if (!j.ok()) {
      Report(j.status());
      MpiAbort(2);
    }
    journal = std::move(j).value();
    ro.on_op_done = [&](OpId i, double start, double end) { journal->Append(i, start, end); };
  }
  Timeline own;
  auto r = RunCpuMpi(t, ro, o.check, &own);
  if (!r.ok()) {
    Report(r.status());
    int me = rank;  // the rank whose ops ran
    for (OpId i = 0; i < own.start.size(); ++i)
      if (own.start[i] >= 0) me = t.rank(i);
    WritePartialTrace(o.trace, t, own, fmt::format("rank{}", me));  // replaces the journal
    MpiAbort(r.status().code() == ErrorCode::kInvalidInput ? 2 : 1);
  }
  if (journal) journal->Remove();
  int code = 0;
  if (r->rank == 0) {
    if (!o.trace.empty()) {
      if (Status s = WriteMeasuredTrace(o.trace, t, r->merged); !s.ok()) code = Report(s);
    }
    fmt::print("{}: {} processes, {} ops, measured step {:.6g} s, loss {:.12g}\n", o.plan, r->world,
               t.size(), r->merged.Makespan(), r->check.loss);
    if (o.check) {
      bool pass = r->check.passed();
      fmt::print(
          "check: loss relative error {:.3g} (bound {:.3g}); max gradient relative error {:.3g} "
          "(bound {:.3g}): {}\n",
          r->check.loss_error, r->check.loss_tolerance, r->check.max_grad_error,
          r->check.grad_tolerance, pass ? "PASS" : "FAIL");
      PrintFp8Effect(r->check);
      if (!pass) code = 1;
    }
  }
  MpiFinalize();
  return code;
#else
  (void)o, (void)t;
  return Report(InvalidInput(
      fmt::format("rank {} of {}: multi-process execution needs MPI, which this pipeplan was "
                  "built without; use --local-ranks",
                  rank, world)));
#endif
}

// One process per GPU over NCCL (--backend cuda under srun / mpirun, or --nccl). NCCL's id
// travels through MPI, or through a file in --rendezvous DIR.
int RunNcclMode(const ExecOptions& o, const Table& t, int rank, int world) {
#ifdef PIPEPLAN_HAS_NCCL
  NcclLaunch l;
  l.process = rank, l.world = world, l.local_rank = LocalRank(rank);
  bool mpi = false;
  FileRendezvous fr{o.rendezvous,
                    o.rendezvous_key.empty() ? DefaultRendezvousKey() : o.rendezvous_key,
                    o.timeout_s};
  if (!o.rendezvous.empty() && fr.key.empty())
    return Report(InvalidInput(
        "--rendezvous outside Slurm needs --rendezvous-key KEY, the same in every process of "
        "this run and unique to it (a leftover file of an earlier run would be read)"));
  if (!o.rendezvous.empty()) {
    l.share_id = [fr, rank, world](std::string* id) {
      return ShareThroughFile(fr, rank, world, id);
    };
    l.joined = [fr] { RemoveRendezvousFile(fr); };
  } else if (world == 1) {
    l.share_id = [](std::string*) { return Status::Ok(); };
  } else {
#ifdef PIPEPLAN_HAS_MPI
    MpiAvailable();
    mpi = true;
    l.share_id = MpiBroadcast;
#else
    return Report(InvalidInput(
        "one process per GPU needs MPI (not built in) or --rendezvous DIR to share NCCL's id"));
#endif
  }
  RunOptions ro;
  ro.op_timeout_s = o.timeout_s;
  ro.fault_rank = o.fault_rank;
  ro.fault_kill = o.fault_kill;
  Timeline own;
  auto r = RunNccl(t, l, ro, o.check, &own);
  if (rank == 0 && !o.rendezvous.empty()) RemoveRendezvousFile(fr);  // also after a failure
  // A failed process aborts the MPI job (its peers stop at once rather than at their
  // timeouts); a failed check is a result, reported by process 0 like a pass.
  auto finish = [&](int code, bool failed) {
#ifdef PIPEPLAN_HAS_MPI
    if (mpi && failed) MpiAbort(code);
    if (mpi) MpiFinalize();
#else
    (void)mpi, (void)failed;
#endif
    return code;
  };
  if (!r.ok()) {
    int code = Report(r.status());
    WritePartialTrace(o.trace, t, own,
                      fmt::format("{}{}", t.ranks()[0].gpus > 1 ? "gpu" : "rank", rank));
    return finish(code, true);
  }
  if (!r->mismatch.empty()) fmt::print(stderr, "error: transfer check: {}\n", r->mismatch);
  int code = o.check && r->bad > 0 ? 1 : 0;
  if (rank == 0) {
    if (!o.trace.empty()) {
      if (Status s = WriteMeasuredTrace(o.trace, t, r->merged); !s.ok()) code = Report(s);
    }
    fmt::print(
        "{}: {} processes (one per GPU, NCCL), {} ops, measured step {:.6g} s; process 0 on {}\n",
        o.plan, world, t.size(), r->merged.Makespan(), r->device);
    if (o.check)
      fmt::print(
          "transfer check: {} transfers and collectives verified on every process, {} wrong: {}\n",
          r->checked, r->bad, r->bad == 0 ? "PASS" : "FAIL");
    if (!o.trace.empty()) fmt::print("trace: {}\n", o.trace);
  }
  return finish(code, false);
#else
  (void)o, (void)t;
  return Report(Internal(fmt::format(
      "rank {} of {}: --backend cuda with one process per GPU needs NCCL, which this pipeplan was "
      "built without (no CUDA compiler or no nccl.h / libnccl at build time)",
      rank, world)));
#endif
}

}  // namespace

Command MakeExecuteCommand() {
  auto o = std::make_shared<ExecOptions>();
  Command c;
  c.setup = [o](CLI::App* app) {
    app->add_option("plan", o->plan, "plan file (.pb or .json)")->required();
    app->add_option("--backend", o->backend, "cpu (tiny model, double precision) or cuda")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    app->add_option("--local-ranks", o->local_ranks, "run all N ranks as threads of this process");
    app->add_option("--rank", o->rank,
                    "this process's rank, with --world (else SLURM_PROCID / OMPI_COMM_WORLD_RANK)");
    app->add_option("--world", o->world,
                    "number of processes (else SLURM_NTASKS / OMPI_COMM_WORLD_SIZE)");
    app->add_flag("--check", o->check,
                  "cpu: compare loss and every gradient with a sequential reference; cuda with "
                  "NCCL: verify every transfer and collective");
    app->add_flag("--nccl", o->nccl,
                  "cuda: one process per GPU over NCCL also when this is the only process "
                  "(implied under srun / mpirun)");
    app->add_option("--rendezvous", o->rendezvous,
                    "NCCL: share NCCL's id through a file in this shared directory instead of MPI");
    app->add_option("--rendezvous-key", o->rendezvous_key,
                    "NCCL: the file's key, unique per job (default SLURM_JOB_ID.SLURM_STEP_ID)");
    app->add_option("--trace", o->trace, "write the measured Chrome trace here");
    app->add_option("--timeout", o->timeout_s, "seconds one RECV or collective may wait");
    app->add_option("--fault", o->fault_rank,
                    "testing fault handling: this rank fails at its first SEND");
    app->add_flag("--fault-kill", o->fault_kill,
                  "with --fault: the rank's process kills itself (SIGKILL) instead, as a crash");
  };
  c.run = [o]() -> int {
    auto t = LoadPlan(o->plan);
    if (!t.ok()) return Report(t.status());
    if (!std::isfinite(o->timeout_s) || o->timeout_s <= 0 || o->timeout_s > 1e6)
      return Report(
          InvalidInput(fmt::format("--timeout {}: expected seconds in (0, 1e6]", o->timeout_s)));
    // The executor trusts the table's structure: run only what the validator accepts.
    if (Status v = ValidatePlan(*t); !v.ok())
      return Report(Status(v.code(), fmt::format("{}: {}", o->plan, v.message())));

    if (o->local_ranks < 0)
      return Report(InvalidInput(fmt::format("--local-ranks {}: expected >= 1", o->local_ranks)));
    if (o->fault_kill && o->fault_rank < 0)
      return Report(InvalidInput("--fault-kill needs --fault RANK"));
    if (o->fault_kill && o->local_ranks > 0)
      return Report(InvalidInput("--fault-kill needs one process per rank (srun / mpirun)"));
    if (o->fault_rank < -1 || o->fault_rank >= t->num_ranks())
      return Report(InvalidInput(
          fmt::format("--fault {}: the plan has ranks 0..{}", o->fault_rank, t->num_ranks() - 1)));
    auto launch = LaunchRank(o->rank, o->world);
    if (!launch.ok()) return Report(launch.status());
    auto [rank, world] = *launch;
    if (o->backend == "cuda" && o->local_ranks == 0 && (o->nccl || world > 1))
      return RunNcclMode(*o, *t, rank, world);
    if (o->nccl) return Report(InvalidInput("--nccl needs --backend cuda and no --local-ranks"));
    if (o->local_ranks == 0 && world > 1) return RunMultiProcess(*o, *t, rank, world);
    const int local = o->local_ranks > 0 ? o->local_ranks : 1;
    if (local != t->num_ranks())
      return Report(InvalidInput(fmt::format("the plan has {} ranks but {} are run (--local-ranks)",
                                             t->num_ranks(), local)));
    RunOptions ro;
    ro.op_timeout_s = o->timeout_s;
    ro.fault_rank = o->fault_rank;
    ro.fault_kill = o->fault_kill;
    Timeline measured;
    StatusOr<CheckResult> r = CheckResult{};
    if (o->backend == "cuda") {
      if (o->check)
        return Report(InvalidInput(
            "--check on one GPU needs --backend cpu (the single-GPU CUDA backend runs shaped "
            "GEMMs; with --nccl, --check verifies every transfer)"));
      r = RunCuda(*t, ro, &measured);
    } else {
      r = RunCpuLocal(*t, ro, o->check, &measured);
    }
    if (!o->trace.empty() &&
        measured.start.size() == t->size()) {  // also after a failure: what ran
      if (Status s = WriteMeasuredTrace(o->trace, *t, measured); !s.ok()) return Report(s);
    }
    if (!r.ok()) return Report(r.status());
    fmt::print("{}: {} ranks, {} ops on {}, measured step {:.6g} s", o->plan, t->num_ranks(),
               t->size(), o->backend, measured.Makespan());
    if (o->backend == "cpu") fmt::print(", loss {:.12g}", r->loss);
    fmt::print("\n");
    if (o->check) {
      bool pass = r->passed();
      fmt::print(
          "check: loss {:.12g} vs reference {:.12g} (relative error {:.3g}, bound {:.3g}); max "
          "gradient relative error {:.3g} ({}, bound {:.3g}): {}\n",
          r->loss, r->reference_loss, r->loss_error, r->loss_tolerance, r->max_grad_error, r->worst,
          r->grad_tolerance, pass ? "PASS" : "FAIL");
      PrintFp8Effect(*r);
      if (!pass) return 1;
    }
    if (!o->trace.empty()) fmt::print("trace: {}\n", o->trace);
    return 0;
  };
  return c;
}

}  // namespace pipeplan
