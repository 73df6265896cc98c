variable "project" {
  description = "GCP project id."
  type        = string
}

variable "region" {
  description = "Region of the server's address."
  type        = string
  default     = "us-central1"
}

variable "zone" {
  description = "Zone of the server and the fleets (pick one with L4 GPUs for the GPU fleet)."
  type        = string
  default     = "us-central1-a"
}

variable "name" {
  description = "Name prefix (groups are <name>-gpu-spot, <name>-gpu-ondemand, <name>-cpu-spot, <name>-cpu-ondemand)."
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
  description = "Source ranges allowed to SSH to the server (default none: use IAP or the serial console)."
  type        = list(string)
  default     = []
}

variable "gpu_machine_type" {
  description = "Machine type of the GPU fleet (g2-standard-4: 4 vCPU, 16 GB, one L4)."
  type        = string
  default     = "g2-standard-4"
}

variable "gpu_image" {
  description = "GPU host image with cloud-init and the NVIDIA driver."
  type        = string
  default     = "ubuntu-os-accelerator-images/ubuntu-accelerator-2204-amd64-with-nvidia-550"
}

variable "cpu_machine_type" {
  description = "Machine type of the CPU fleet."
  type        = string
  default     = "n2-standard-4"
}

variable "boinc_dl_version" {
  description = "boinc-dl release the hosts install from the package index."
  type        = string
  default     = "0.2.0"
}
