// The polynomial both libraries' exponentials use: 2^f for f in [-0.5, 0.5] by its Taylor
// series to degree 6 (relative error ~1.2e-7), highest power first (Horner's order).
#pragma once

namespace blockserve_cpu {

constexpr float kLog2E = 1.4426950408889634f;
constexpr float kExp2Taylor[] = {
    1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
    5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f,
    1.0f,
};

}  // namespace blockserve_cpu
