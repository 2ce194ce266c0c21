// The op table's lookup and the schema helpers shared by parser, Builder, verifier and executor.
#include "funcol/graph/ops.h"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "ops_table.h"

namespace funcol {

std::string_view collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::None: return "none";
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::AllToAll: return "all_to_all";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::Wait: return "wait";
  }
  return "?";
}

const Attr& AttrList::get(std::string_view name) const {
  const int i = op_->attr_index(name);
  FUNCOL_CHECK(i >= 0 && static_cast<size_t>(i) < values_.size(),
               fmt::format("op {} has no attribute '{}'", op_->name, name));
  return values_[static_cast<size_t>(i)];
}

int OpDef::attr_index(std::string_view attr_name) const {
  for (size_t i = 0; i < attrs.size(); ++i) {
    if (attrs[i].name == attr_name) return static_cast<int>(i);
  }
  return -1;
}

std::string OpDef::operand_count_str() const {
  return fmt::format("{}{} operand{}", variadic ? "at least " : "", num_operands,
                     num_operands == 1 ? "" : "s");
}

void OpDef::check_operand_count(size_t n) const {
  const auto want = static_cast<size_t>(num_operands);
  if (variadic ? n < want : n != want) {
    throw InvalidArgument(fmt::format("{} expects {}, got {}", name, operand_count_str(), n));
  }
}

std::span<const OpDef> all_ops() {
  static const std::vector<OpDef> table = detail::build_op_table();
  return table;
}

const OpDef* find_op(std::string_view name) {
  static const auto index = [] {
    std::unordered_map<std::string_view, const OpDef*> m;
    for (const OpDef& op : all_ops()) {
      FUNCOL_CHECK(m.emplace(op.name, &op).second, "duplicate op " + std::string(op.name));
    }
    return m;
  }();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

const OpDef& get_op(std::string_view name) {
  const OpDef* op = find_op(name);
  if (!op) throw InvalidArgument(fmt::format("unknown op '{}'", name));
  return *op;
}

void coerce_attr(const OpDef& op, const AttrSpec& spec, Attr& value) {
  const AttrKind have = value.kind();
  bool ok = have == spec.kind;
  if (!ok && spec.kind == AttrKind::Float && have == AttrKind::Int) {
    if (!spec.keeps_exact) value = Attr(static_cast<double>(value.as_int()));
    ok = true;
  }
  if (!ok && spec.kind == AttrKind::Float && have == AttrKind::Bool) ok = spec.keeps_exact;
  if (!ok && spec.kind == AttrKind::IntList && have == AttrKind::List) {
    const auto& items = value.as_list();
    if (std::all_of(items.begin(), items.end(),
                    [](const Attr& a) { return a.kind() == AttrKind::Int; })) {
      std::vector<int64_t> ints;
      ints.reserve(items.size());
      for (const Attr& a : items) ints.push_back(a.as_int());
      value = Attr(std::move(ints));
      ok = true;
    }
  }
  if (!ok && spec.kind == AttrKind::List && have == AttrKind::IntList) {
    std::vector<Attr> items;
    for (int64_t v : value.as_ints()) items.emplace_back(v);
    value = Attr::list(std::move(items));
    ok = true;
  }
  if (!ok) {
    std::string shown = value.str();
    if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
    throw InvalidArgument(fmt::format("attribute '{}' of {} must be {}, got {}", spec.name,
                                      op.name, spec.description(), shown));
  }
  if (spec.canonicalize) spec.canonicalize(value);
}

std::vector<Attr> make_attrs(const OpDef& op, const NamedAttrs& named) {
  std::vector<Attr> values(op.attrs.size());
  for (const auto& [name, value] : named) {
    const int i = op.attr_index(name);
    if (i < 0) {
      throw InvalidArgument(fmt::format("unknown attribute '{}' for op {}", name, op.name));
    }
    Attr& slot = values[static_cast<size_t>(i)];
    if (slot.has_value()) {
      throw InvalidArgument(fmt::format("duplicate attribute '{}' for op {}", name, op.name));
    }
    slot = value;
    coerce_attr(op, op.attrs[static_cast<size_t>(i)], slot);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].has_value()) continue;
    const AttrSpec& spec = op.attrs[i];
    if (spec.required) {
      throw InvalidArgument(
          fmt::format("missing attribute '{}' for op {}", spec.name, op.name));
    }
    values[i] = spec.default_value;
  }
  return values;
}

std::vector<Type> infer_types(const OpDef& op, std::span<const Type> inputs,
                              std::span<const Attr> attrs) {
  op.check_operand_count(inputs.size());
  FUNCOL_CHECK(attrs.size() == op.attrs.size(),
               fmt::format("{}: {} attribute values for {} schema entries", op.name,
                           attrs.size(), op.attrs.size()));
  try {
    return op.infer(inputs, AttrList(op, attrs));
  } catch (const ShapeError& e) {
    throw ShapeError(fmt::format("{}: {}", op.name, e.what()));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: {}", op.name, e.what()));
  }
}

std::vector<Tensor> run_kernel(const OpDef& op, std::span<const Tensor> inputs,
                               std::span<const Attr> attrs) {
  if (!op.kernel) {
    throw InvalidArgument(fmt::format("{} has no CPU kernel (collectives run through a "
                                      "process group)",
                                      op.name));
  }
  op.check_operand_count(inputs.size());
  return op.kernel(inputs, AttrList(op, attrs));
}

}  // namespace funcol
