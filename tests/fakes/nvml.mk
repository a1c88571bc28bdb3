# The fake libnvidia-ml.so.1 (tests/fakes/fake_nvml.c): `make -f tests/fakes/nvml.mk OUT=DIR`
# builds DIR/libnvidia-ml.so.1. Written to be included by tests/fakes/Makefile as one rule.
NVML_SRC_DIR := $(dir $(lastword $(MAKEFILE_LIST)))
OUT          ?= build
CC           ?= cc
NVML_CFLAGS  := -std=gnu11 -O2 -g -fPIC -fvisibility=hidden -D_GNU_SOURCE \
                -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes

.PHONY: fake-nvml
fake-nvml: $(OUT)/libnvidia-ml.so.1

NVML_SRCS    := $(NVML_SRC_DIR)fake_nvml.c $(NVML_SRC_DIR)fake_nvml_mig.c $(NVML_SRC_DIR)fake_nvml_gi.c \
                $(NVML_SRC_DIR)fake_nvml_limits.c

$(OUT)/libnvidia-ml.so.1: $(NVML_SRCS) $(NVML_SRC_DIR)fake_nvml.h
	@mkdir -p $(dir $@)
	$(CC) $(NVML_CFLAGS) -shared -Wl,-soname,libnvidia-ml.so.1 -Wl,-z,defs -o $@ $(NVML_SRCS) -lpthread
