#include "records.h"

#include <fstream>
#include <sstream>

#include "loom/error.h"

namespace loom::datasets {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK_AS(DataError, in.good(), path, ": cannot read (missing or unreadable)");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void read_jsonl(const std::string& path, std::vector<Record>& out) {
  std::istringstream in(read_all(path));
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json value;
    try {
      value = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& error) {
      throw DataError(detail::cat(path, ":", number, ": not a JSON object (", error.what(),
                                  "); JSONL needs one object per line"));
    }
    LOOM_CHECK_AS(DataError, value.is_object(), path, ":", number, ": a JSON ", value.type_name(),
                  ", not an object; JSONL needs one object per line, like {\"text\": \"...\"}");
    out.push_back({std::move(value), detail::cat(path, ":", number)});
  }
}

// RFC 4180: fields separated by commas, optionally quoted; "" is a quote inside quotes; quoted
// fields may hold newlines. The first row names the fields.
void read_csv(const std::string& path, std::vector<Record>& out) {
  const std::string text = read_all(path);
  std::vector<std::vector<std::string>> rows;
  std::vector<int64_t> row_lines;
  std::vector<std::string> row;
  std::string field;
  bool quoted = false, field_started = false;
  int64_t line = 1, row_line = 1;
  size_t i = 0;
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) i = 3;  // a BOM (spreadsheets write one)
  auto end_row = [&] {
    row.push_back(std::move(field));
    field.clear();
    field_started = false;
    if (!(row.size() == 1 && row[0].empty())) {  // skip blank lines
      rows.push_back(std::move(row));
      row_lines.push_back(row_line);
    }
    row.clear();
  };
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field.push_back('"');
          ++i;
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        field.push_back(c);
      }
      continue;
    }
    if (c == '"' && !field_started) {
      quoted = field_started = true;
    } else if (c == ',') {
      row.push_back(std::move(field));
      field.clear();
      field_started = false;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      end_row();
      row_line = ++line;
    } else {
      field.push_back(c);
      field_started = true;
    }
  }
  LOOM_CHECK_AS(DataError, !quoted, path, ":", row_line,
                ": a quoted field is never closed (a \" is missing)");
  if (field_started || !row.empty()) end_row();
  LOOM_CHECK_AS(DataError, !rows.empty(), path, ": empty; a CSV needs a header row naming its "
                "fields (text,label ...) and then one row per example");
  const auto& header = rows.front();
  for (size_t r = 1; r < rows.size(); ++r) {
    LOOM_CHECK_AS(DataError, rows[r].size() == header.size(), path, ":", row_lines[r], ": ",
                  rows[r].size(), " fields, but the header has ", header.size(),
                  " (quote fields that hold commas)");
    nlohmann::json fields = nlohmann::json::object();
    for (size_t k = 0; k < header.size(); ++k) fields[header[k]] = rows[r][k];
    out.push_back({std::move(fields), detail::cat(path, ":", row_lines[r])});
  }
}

}  // namespace

std::vector<Record> read_records(const std::vector<std::string>& files, Format format) {
  std::vector<Record> out;
  for (const auto& path : files) {
    if (format == Format::Jsonl) read_jsonl(path, out);
    else read_csv(path, out);
  }
  return out;
}

std::string field_names(const nlohmann::json& fields) {
  std::string names;
  for (const auto& [key, value] : fields.items()) names += (names.empty() ? "" : ", ") + key;
  return names.empty() ? "none" : names;
}

}  // namespace loom::datasets
