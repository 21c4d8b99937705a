// Umbrella header: parameter averaging, the model averagers and PostLocalSGDOptimizer.
#pragma once

#include <ddpx/comm/average.h>
#include <ddpx/optim/averagers.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
