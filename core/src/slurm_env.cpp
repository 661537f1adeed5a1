// Slurm's compressed task counts and hostlists (slurm_env.h).
#include "slurm_env.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "loom/error.h"

namespace loom {
namespace {

// A job has at most some hundred thousand nodes; the cap makes a corrupt value such as
// "n[0-999999999]" an error instead of a process that expands it until memory runs out.
constexpr size_t kMaxNodes = size_t{1} << 20;

// Throws the ConfigError for one variable's value: what it should be, and why it is not.
struct Complaint {
  std::string_view text, variable;
  const char* what;
  [[noreturn]] void operator()(const std::string& why) const {
    throw ConfigError(detail::cat("environment ", variable, "='", text, "' is not ", what, ": ",
                                  why, "; srun sets it for each task (was it set by hand?)"));
  }
};

// Decimal digits only (no sign, no spaces), at most nine: every count and node number fits.
bool read_number(std::string_view digits, long& value) {
  if (digits.empty() || digits.size() > 9) return false;
  value = 0;
  for (char c : digits) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    value = value * 10 + (c - '0');
  }
  return true;
}

// The numbers one pair of brackets names ("01-04,07"), each as wide as the first number of its
// range: Slurm keeps the zeros of padded node names.
std::vector<std::string> expand_brackets(std::string_view inside, const Complaint& bad) {
  if (inside.empty()) bad("it has empty brackets");
  std::vector<std::string> numbers;
  size_t start = 0;
  while (start <= inside.size()) {
    const size_t comma = std::min(inside.find(',', start), inside.size());
    const std::string_view piece = inside.substr(start, comma - start);
    const size_t dash = piece.find('-');
    const std::string_view low_text = piece.substr(0, dash);
    const std::string_view high_text =
        dash == std::string_view::npos ? low_text : piece.substr(dash + 1);
    long low = 0, high = 0;
    if (!read_number(low_text, low) || !read_number(high_text, high))
      bad(detail::cat("'", piece, "' in [", inside, "] is neither a number nor a range A-B"));
    if (high < low) bad(detail::cat("the range ", piece, " in [", inside, "] counts down"));
    if (numbers.size() + static_cast<size_t>(high - low) >= kMaxNodes)
      bad(detail::cat("it names more than ", kMaxNodes, " hosts"));
    for (long n = low; n <= high; ++n) {
      std::string number = std::to_string(n);
      if (number.size() < low_text.size()) number.insert(0, low_text.size() - number.size(), '0');
      numbers.push_back(std::move(number));
    }
    start = comma + 1;
  }
  return numbers;
}

// One name of the list ("n[1-2]-ib[0-1]"), appended to `hosts`: every combination of its
// brackets' numbers, the leftmost bracket varying slowest.
void expand_name(std::string_view name, std::vector<std::string>& hosts, const Complaint& bad) {
  if (name.empty()) bad("it has an empty name (two commas in a row, or one at an end)");
  std::vector<std::string> names{""};
  size_t at = 0;
  while (at < name.size()) {
    const size_t open = name.find('[', at);
    std::vector<std::string> choices;
    if (open == at) {
      const size_t close = name.find(']', open);  // the caller checked that brackets pair up
      choices = expand_brackets(name.substr(open + 1, close - open - 1), bad);
      at = close + 1;
    } else {
      choices = {std::string(name.substr(at, open - at))};
      at = open == std::string_view::npos ? name.size() : open;
    }
    if (hosts.size() + names.size() * choices.size() > kMaxNodes)
      bad(detail::cat("it names more than ", kMaxNodes, " hosts"));
    std::vector<std::string> longer;
    longer.reserve(names.size() * choices.size());
    for (const auto& head : names)
      for (const auto& tail : choices) longer.push_back(head + tail);
    names = std::move(longer);
  }
  hosts.insert(hosts.end(), names.begin(), names.end());
}

}  // namespace

std::vector<int> parse_slurm_task_counts(std::string_view text, std::string_view variable) {
  const Complaint bad{text, variable, "a list of Slurm task counts (N, or N(xK) for K nodes of "
                                     "N tasks, separated by commas)"};
  if (text.empty()) bad("it is empty");
  std::vector<int> counts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    std::string_view count = item, repeat = "1";
    if (const size_t open = item.find('('); open != std::string_view::npos) {
      count = item.substr(0, open);
      const std::string_view rest = item.substr(open);
      repeat = rest.size() >= 3 && rest.substr(0, 2) == "(x" && rest.back() == ')'
                   ? rest.substr(2, rest.size() - 3)
                   : std::string_view();
    }
    long tasks = 0, nodes = 0;
    if (!read_number(count, tasks) || tasks < 1 || !read_number(repeat, nodes) || nodes < 1)
      bad(detail::cat("'", item, "' is neither N nor N(xK) with N, K >= 1"));
    if (counts.size() + static_cast<size_t>(nodes) > kMaxNodes)
      bad(detail::cat("it counts more than ", kMaxNodes, " nodes"));
    counts.insert(counts.end(), static_cast<size_t>(nodes), static_cast<int>(tasks));
    start = comma + 1;
  }
  return counts;
}

std::vector<std::string> expand_slurm_hostlist(std::string_view text, std::string_view variable) {
  const Complaint bad{text, variable, "a Slurm hostlist (names separated by commas, with "
                                     "ranges in brackets: node[01-04,07])"};
  if (text.empty()) bad("it is empty");
  std::vector<std::string> hosts;
  bool in_brackets = false;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c)))
      bad("it has a space or control character");
    if (c == '[' && in_brackets) bad("it has a '[' inside brackets");
    if (c == ']' && !in_brackets) bad("it has a ']' without its '['");
    if (c == '[' || c == ']') in_brackets = c == '[';
    if (c == ',' && !in_brackets) {
      expand_name(text.substr(start, i - start), hosts, bad);
      start = i + 1;
    }
  }
  if (in_brackets) bad("a '[' is never closed");
  expand_name(text.substr(start), hosts, bad);
  return hosts;
}

}  // namespace loom
