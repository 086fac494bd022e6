// engine/report.h: what a run shows and leaves behind: a progress bar with rate and ETA (stderr), metrics as
// JSON lines, and an SVG plot of the loss and test-metric curves (written by our own code, no dependency).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace pathattn::engine {

// A one-line progress bar on stderr: "label [=====>    ] 120/1000 12.3 it/s ETA 1m12s <extra>".
// Redrawn in place on a terminal (at most 10 times a second); one line per 10% otherwise.
class Progress {
 public:
  Progress(std::string label, int64_t total, int64_t start = 0, bool enabled = true);
  void update(int64_t done, const std::string& extra = "");
  void finish(const std::string& extra = "");
  double elapsed_s() const;

 private:
  void draw(int64_t done, const std::string& extra, bool final);
  std::string label_;
  int64_t total_, start_;
  bool enabled_, tty_;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point t0_, last_draw_;
};

// Formats seconds as "1h02m", "3m05s" or "12.3s".
std::string format_duration(double s);

// The dense bf16 tensor-core peak (FLOP/s) of a GPU by its device name, as the vendor's data sheets give it: the
// denominator of MFU, whatever precision the engine's products run in (the convention of llm.c). 0: not listed.
double bf16_peak_flops(const std::string& device_name);

// Appends one JSON object per line to a metrics file; truncate_after(step) drops lines with "step" > step
// (used when a run resumes from a checkpoint so the file matches the restored state).
class MetricsLog {
 public:
  explicit MetricsLog(std::string path) : path_(std::move(path)) {}
  void append(const nlohmann::json& j) const;
  void truncate_after(int64_t step) const;
  std::vector<nlohmann::json> read() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes an SVG with two panels from metrics records: training loss against step (log scale) and, for each
// test set, the test metric (key `metric`, e.g. "error" or "accuracy") against step. Atomic write.
void write_plot_svg(const std::string& path, const std::vector<nlohmann::json>& records, const std::string& title,
                    const std::string& metric);

// One panel of a grid plot: named series of (x, y) points.
struct PlotPanel {
  std::string title;
  std::vector<std::pair<std::string, std::vector<std::pair<double, double>>>> series;
};
// Writes an SVG grid of panels (`columns` per row) sharing the legend order: x on a log2 axis with a tick at
// every x a series has (e.g. evaluation lengths), y on [0, 1] (a fraction, labelled as %). Atomic write.
void write_grid_svg(const std::string& path, const std::string& title, const std::vector<PlotPanel>& panels,
                    const std::string& xlabel, const std::string& ylabel, int columns = 3);

// Writes a text file atomically (temp + fsync + rename).
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace pathattn::engine
