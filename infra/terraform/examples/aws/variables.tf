variable "region" {
  description = "AWS region of the server and the fleets."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Name prefix (groups are <name>-gpu-spot and <name>-cpu-spot)."
  type        = string
  default     = "bdl"
}

variable "source_repo" {
  description = "Git URL of the boinc-dl source the server builds its docker stack from."
  type        = string
}

variable "source_ref" {
  description = "Release tag of source_repo."
  type        = string
  default     = "v0.2.0"
}

variable "admin_ssh_cidrs" {
  description = "CIDRs allowed to SSH to the server (default none: use SSM Session Manager)."
  type        = list(string)
  default     = []
}

variable "gpu_instance_types" {
  description = "GPU types of the GPU fleet (one NVIDIA GPU each)."
  type        = list(string)
  default     = ["g4dn.xlarge", "g5.xlarge", "g6.xlarge", "g4dn.2xlarge"]
}

variable "cpu_instance_types" {
  description = "Types of the CPU fleet."
  type        = list(string)
  default     = ["c6i.xlarge", "c5.xlarge", "m6i.xlarge", "c7i.xlarge"]
}

variable "gpu_max_hosts" {
  description = "Largest size of the GPU fleet."
  type        = number
  default     = 32
}

variable "cpu_max_hosts" {
  description = "Largest size of the CPU fleet."
  type        = number
  default     = 64
}

variable "boinc_dl_version" {
  description = "boinc-dl release the hosts install from the package index."
  type        = string
  default     = "0.2.0"
}
