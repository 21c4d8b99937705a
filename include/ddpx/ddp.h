// ddpx's DistributedDataParallel for C++ programs and the process group torchrun's environment
// describes: one include for a training program.
#pragma once

#include <ddpx/ddp/distributed_data_parallel.h>
#include <ddpx/ddp/process_group_env.h>
