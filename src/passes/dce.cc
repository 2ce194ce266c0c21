// Dead code elimination in one backward sweep over the node order.
#include "funcol/passes/dce.h"

namespace funcol {

bool eliminate_dead_code(Graph& graph) {
  bool changed = false;
  // Users come after their producers, so walking backwards frees whole dead chains in one sweep.
  for (Node* n = graph.last_node(); n;) {
    Node* prev = n->prev();
    if (!n->op().has_side_effect && !n->has_uses()) {
      graph.erase(n);
      changed = true;
    }
    n = prev;
  }
  return changed;
}

}  // namespace funcol
