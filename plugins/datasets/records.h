// Records of a JSONL or CSV file: one JSON object each (a CSV row becomes an object of strings,
// keyed by the header), with where it came from for error messages.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace loom::datasets {

struct Record {
  nlohmann::json fields;  // an object
  std::string where;      // "file:line"
};

enum class Format { Jsonl, Csv };

// Every record of `files`, in order. A line that is not a JSON object, a CSV row with the wrong
// number of fields, an unterminated quote: DataError naming the file and line. Blank JSONL
// lines are skipped.
std::vector<Record> read_records(const std::vector<std::string>& files, Format format);

// "a, b, c": the field names of a record, for "missing field" messages.
std::string field_names(const nlohmann::json& fields);

}  // namespace loom::datasets
