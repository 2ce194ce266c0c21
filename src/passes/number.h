// Whole-string number parsing shared by the pass options.
#pragma once

#include <charconv>
#include <string_view>
#include <system_error>

namespace funcol {

// std::from_chars over all of `text`, taking a leading '+' as C's strtod and Python's float()
// do (std::from_chars does not; "+-1" stays refused). `whole`: a number was read and it was the
// whole of `text`; `ec` is from_chars' (result_out_of_range for a value past the type's range).
template <typename T>
struct WholeNumber {
  T value = 0;
  bool whole = false;
  std::errc ec{};
};

template <typename T>
WholeNumber<T> parse_whole_number(std::string_view text) {
  const bool plus = text.size() > 1 && text[0] == '+' && text[1] != '-' && text[1] != '+';
  const char* first = text.data() + (plus ? 1 : 0);
  const char* last = text.data() + text.size();
  WholeNumber<T> r;
  const auto [ptr, ec] = std::from_chars(first, last, r.value);
  r.whole = first != last && ptr == last;
  r.ec = ec;
  return r;
}

}  // namespace funcol
