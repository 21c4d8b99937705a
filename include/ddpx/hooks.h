// Umbrella header: every ddpx communication hook.
#pragma once

#include <ddpx/comm/exchange_mode.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/comm_hook.h>
#include <ddpx/hooks/compress_hook.h>
#include <ddpx/hooks/compress_wrapper.h>
#include <ddpx/hooks/ddp_zero_hook.h>
#include <ddpx/hooks/noop_hook.h>
#include <ddpx/hooks/post_localsgd_hook.h>
#include <ddpx/hooks/powersgd_hook.h>
#include <ddpx/hooks/powersgd_state.h>
#include <ddpx/hooks/quantization_hook.h>
#include <ddpx/hooks/quantized_hook.h>
#include <ddpx/hooks/zero_reduce_scatter_hook.h>
