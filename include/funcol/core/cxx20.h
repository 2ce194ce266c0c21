// funcol's headers need C++20: one clear error first, before the many the headers' C++20 parts
// would give under an older standard (every header of funcol reaches this one).
#pragma once

#if __cplusplus < 202002L
#error "funcol needs C++20 or newer: compile with -std=c++20 (or a later standard)"
#endif
