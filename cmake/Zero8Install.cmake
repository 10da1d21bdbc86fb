# Install rules and the CMake package config (find_package(zero8)).
