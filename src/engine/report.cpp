// engine/report.cpp: progress bar, JSON-lines metrics and the SVG curve plot (engine/report.h).
#include "engine/report.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "engine/config.h"

namespace pathattn::engine {

using nlohmann::json;

std::string format_duration(double s) {
  char buf[32];
  if (!std::isfinite(s) || s < 0) return "?";
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(std::fmod(s, 3600) / 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(std::fmod(s, 60)));
  else std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

Progress::Progress(std::string label, int64_t total, int64_t start, bool enabled)
    : label_(std::move(label)), total_(total), start_(start), enabled_(enabled), tty_(isatty(2) != 0) {
  t0_ = last_draw_ = std::chrono::steady_clock::now();
}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

void Progress::update(int64_t done, const std::string& extra) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (std::chrono::duration<double>(now - last_draw_).count() < 0.1 && done < total_) return;
    last_draw_ = now;
    draw(done, extra, false);
  } else {
    const int dec = total_ > 0 ? int(10 * done / total_) : 10;
    if (dec == last_decile_) return;
    last_decile_ = dec;
    draw(done, extra, false);
  }
}

void Progress::finish(const std::string& extra) {
  if (!enabled_) return;
  draw(total_, extra, true);
}

void Progress::draw(int64_t done, const std::string& extra, bool final) {
  const double el = elapsed_s();
  const double rate = el > 0 ? double(done - start_) / el : 0.0;
  const double eta = rate > 0 ? double(total_ - done) / rate : NAN;
  const int width = 24;
  const int fill = total_ > 0 ? int(width * std::min<int64_t>(done, total_) / total_) : width;
  std::string bar(size_t(fill), '=');
  if (fill < width) bar += '>' + std::string(size_t(width - fill - 1), ' ');
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s [%s] %lld/%lld %.2f it/s %s %s", label_.c_str(), bar.c_str(),
                (long long)done, (long long)total_, rate, final ? "in" : "ETA",
                format_duration(final ? el : eta).c_str());
  std::string line = std::string(buf) + (extra.empty() ? "" : " " + extra);
  if (tty_) std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
  else std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

double bf16_peak_flops(const std::string& device_name) {
  // First match wins: the more specific names first ("H100 PCIe" before "H100"; "GH200" holds "H200").
  static const struct {
    const char* name;
    double flops;
  } kPeaks[] = {{"H200", 989.4e12}, {"H100 NVL", 835.0e12}, {"H100 PCIe", 756.0e12}, {"H100", 989.4e12},
                {"A100", 312.0e12}};
  for (const auto& p : kPeaks)
    if (device_name.find(p.name) != std::string::npos) return p.flops;
  return 0.0;
}

void MetricsLog::append(const json& j) const {
  std::ofstream f(path_, std::ios::app);
  if (!f) throw EngineError(path_ + ": cannot append metrics");
  f << j.dump() << "\n";
}

std::vector<json> MetricsLog::read() const {
  std::vector<json> out;
  std::ifstream f(path_);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    try {
      out.push_back(json::parse(line));
    } catch (const json::parse_error&) {
      // A line cut short by a crash: ignored (the checkpoint, not the log, is the state).
    }
  }
  return out;
}

void MetricsLog::truncate_after(int64_t step) const {
  std::string kept;
  for (const json& j : read())
    if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step)
      kept += j.dump() + "\n";
  write_file_atomic(path_, kept);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw EngineError(tmp + ": cannot create");
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t w = ::write(fd, text.data() + off, text.size() - off);
    if (w < 0) {
      ::close(fd);
      throw EngineError(tmp + ": write failed");
    }
    off += size_t(w);
  }
  ::fsync(fd);
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw EngineError(path + ": rename failed");
}

namespace {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> pts;
};

// One panel: axes at (x0, y0) of size (w, h), the series as polylines, min/max labels.
void panel(std::ostringstream& s, double x0, double y0, double w, double h, const std::vector<Series>& series,
           bool logy, const std::string& ylabel) {
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
  auto ty = [&](double y) { return logy ? std::log10(std::max(y, 1e-6)) : y; };
  for (const Series& sr : series)
    for (auto [x, y] : sr.pts) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymin = std::min(ymin, ty(y));
      ymax = std::max(ymax, ty(y));
    }
  s << "<rect x='" << x0 << "' y='" << y0 << "' width='" << w << "' height='" << h
    << "' fill='none' stroke='#888'/>\n";
  s << "<text x='" << x0 << "' y='" << y0 - 6 << "' font-size='12'>" << ylabel << "</text>\n";
  if (xmin > xmax) return;
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) {
    ymax += 0.5;
    ymin -= 0.5;
  }
  auto X = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * w; };
  auto Y = [&](double y) { return y0 + h - (ty(y) - ymin) / (ymax - ymin) * h; };
  char buf[64];
  auto label = [&](double v) {
    std::snprintf(buf, sizeof buf, "%.4g", logy ? std::pow(10.0, v) : v);
    return std::string(buf);
  };
  s << "<text x='" << x0 - 4 << "' y='" << y0 + 10 << "' font-size='10' text-anchor='end'>" << label(ymax)
    << "</text>\n";
  s << "<text x='" << x0 - 4 << "' y='" << y0 + h << "' font-size='10' text-anchor='end'>" << label(ymin)
    << "</text>\n";
  s << "<text x='" << x0 << "' y='" << y0 + h + 14 << "' font-size='10'>" << xmin << "</text>\n";
  s << "<text x='" << x0 + w << "' y='" << y0 + h + 14 << "' font-size='10' text-anchor='end'>step " << xmax
    << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const char* c = colors[i % 6];
    s << "<polyline fill='none' stroke='" << c << "' stroke-width='1.5' points='";
    for (auto [x, y] : series[i].pts) s << X(x) << "," << Y(y) << " ";
    s << "'/>\n";
    for (auto [x, y] : series[i].pts)
      if (series[i].pts.size() < 60) s << "<circle cx='" << X(x) << "' cy='" << Y(y) << "' r='2' fill='" << c << "'/>\n";
    s << "<text x='" << x0 + w - 4 << "' y='" << y0 + 14 + 13 * double(i) << "' font-size='11' text-anchor='end' fill='"
      << c << "'>" << series[i].name << "</text>\n";
  }
}

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

// One grid panel at (x0, y0) of size (w, h): log2 x with a tick per distinct x, y fixed to [0, 1].
void grid_panel(std::ostringstream& s, double x0, double y0, double w, double h, const PlotPanel& p,
                const std::string& xlabel) {
  std::vector<double> xs;
  for (const auto& sr : p.series)
    for (auto [x, y] : sr.second)
      if (x > 0) xs.push_back(x);
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  s << "<rect x='" << x0 << "' y='" << y0 << "' width='" << w << "' height='" << h
    << "' fill='none' stroke='#888'/>\n";
  s << "<text x='" << x0 + w / 2 << "' y='" << y0 - 6 << "' font-size='12' text-anchor='middle'>" << p.title
    << "</text>\n";
  for (double f : {0.0, 0.5, 1.0}) {
    const double y = y0 + h - f * h;
    s << "<line x1='" << x0 << "' y1='" << y << "' x2='" << x0 + w << "' y2='" << y << "' stroke='#eee'/>\n";
    s << "<text x='" << x0 - 4 << "' y='" << y + 4 << "' font-size='10' text-anchor='end'>" << int(100 * f)
      << "%</text>\n";
  }
  if (xs.empty()) return;
  const double lo = std::log2(xs.front()), hi = std::max(std::log2(xs.back()), lo + 1);
  auto X = [&](double x) { return x0 + 8 + (std::log2(x) - lo) / (hi - lo) * (w - 16); };
  auto Y = [&](double y) { return y0 + h - std::clamp(y, 0.0, 1.0) * h; };
  for (double x : xs)
    s << "<text x='" << X(x) << "' y='" << y0 + h + 13 << "' font-size='10' text-anchor='middle'>" << x
      << "</text>\n";
  s << "<text x='" << x0 + w / 2 << "' y='" << y0 + h + 26 << "' font-size='10' text-anchor='middle'>" << xlabel
    << "</text>\n";
  for (size_t i = 0; i < p.series.size(); ++i) {
    const char* c = kColors[i % 6];
    s << "<polyline fill='none' stroke='" << c << "' stroke-width='1.5' points='";
    for (auto [x, y] : p.series[i].second) s << X(x) << "," << Y(y) << " ";
    s << "'/>\n";
    for (auto [x, y] : p.series[i].second) s << "<circle cx='" << X(x) << "' cy='" << Y(y) << "' r='2.5' fill='" << c << "'/>\n";
  }
}

}  // namespace

void write_grid_svg(const std::string& path, const std::string& title, const std::vector<PlotPanel>& panels,
                    const std::string& xlabel, const std::string& ylabel, int columns) {
  const int cols = std::max(1, columns), rows = int((panels.size() + size_t(cols) - 1) / size_t(cols));
  const double pw = 260, ph = 170, gx = 70, gy = 70;
  const double W = 60 + cols * (pw + gx), H = 80 + rows * (ph + gy) + 20;
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif'>\n";
  s << "<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << W / 2 << "' y='20' font-size='14' text-anchor='middle'>" << title << "</text>\n";
  s << "<text x='" << W / 2 << "' y='38' font-size='11' text-anchor='middle'>y: " << ylabel << "</text>\n";
  // The legend: the series names of the first panel, in their colors.
  if (!panels.empty())
    for (size_t i = 0; i < panels[0].series.size(); ++i)
      s << "<text x='" << 60 + 110 * double(i) << "' y='56' font-size='12' fill='" << kColors[i % 6] << "'>"
        << panels[0].series[i].first << "</text>\n";
  for (size_t i = 0; i < panels.size(); ++i) {
    const double x0 = 60 + double(i % size_t(cols)) * (pw + gx), y0 = 90 + double(i / size_t(cols)) * (ph + gy);
    grid_panel(s, x0, y0, pw, ph, panels[i], xlabel);
  }
  s << "</svg>\n";
  write_file_atomic(path, s.str());
}

void write_plot_svg(const std::string& path, const std::vector<json>& records, const std::string& title,
                    const std::string& metric) {
  Series loss{"train loss", {}};
  std::map<std::string, Series> evals;
  for (const json& r : records) {
    if (!r.contains("step")) continue;
    const double step = r["step"].get<double>();
    if (r.contains("loss") && r["loss"].is_number()) loss.pts.push_back({step, r["loss"].get<double>()});
    if (r.contains("eval") && r["eval"].is_object())
      for (auto it = r["eval"].begin(); it != r["eval"].end(); ++it)
        if (it.value().contains(metric)) {
          Series& s = evals[it.key()];
          s.name = it.key() + " " + metric;
          s.pts.push_back({step, it.value()[metric].get<double>()});
        }
  }
  std::vector<Series> ev;
  for (auto& [k, s] : evals) ev.push_back(s);
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='900' height='360' font-family='sans-serif'>\n";
  s << "<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='450' y='20' font-size='14' text-anchor='middle'>" << title << "</text>\n";
  panel(s, 70, 50, 340, 260, {loss}, true, "training loss (log scale)");
  panel(s, 520, 50, 340, 260, ev, false, "test " + metric);
  s << "</svg>\n";
  write_file_atomic(path, s.str());
}

}  // namespace pathattn::engine
