// What the block layer's drivers share: the registry's types (vblk/open.h).
// Each driver keeps its entry points in its own files and registers one
// DriverInfo (drivers/list.h); nothing outside its folder calls it.
#pragma once

#include "vblk/open.h"
