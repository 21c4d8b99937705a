// Umbrella header: parameter averaging, the model averagers and PostLocalSGDOptimizer.
#pragma once

#include <ddpx/averaging/average.h>
#include <ddpx/averaging/averagers.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
