variable "name" {
  description = "Name of the auto scaling group; the queue is <name>-interruptions (e.g. bdl-gpu-spot)."
  type        = string
}

variable "region" {
  description = "AWS region of the fleet (the hosts read the weak key from Secrets Manager there)."
  type        = string
}

variable "variant" {
  description = "gpu or cpu: which boinc-dl extra the hosts install (boinc-dl[gpu] or boinc-dl[cpu])."
  type        = string
  default     = "gpu"
  validation {
    condition     = contains(["gpu", "cpu"], var.variant)
    error_message = "variant must be gpu or cpu."
  }
}

variable "instance_types" {
  description = "Instance types the group may launch (several, so price-capacity-optimized can choose)."
  type        = list(string)
  validation {
    condition     = length(var.instance_types) >= 2
    error_message = "Give at least two instance types: one type is one spot pool."
  }
}

variable "ami_id" {
  description = "Host image: for gpu, a GPU-ready image with the NVIDIA driver (e.g. a Deep Learning Base AMI, Ubuntu); for cpu, Ubuntu 22.04/24.04."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets (one per availability zone: more zones, more spot pools)."
  type        = list(string)
}

variable "vpc_id" {
  description = "VPC of the hosts' security group."
  type        = string
}

variable "project_url" {
  description = "Master URL of the BOINC project the hosts attach to (the server module's project_url)."
  type        = string
}

variable "weak_key_secret_arn" {
  description = "Secrets Manager secret holding the project's weak account key (read at boot by the hosts)."
  type        = string
}

variable "kms_key_arn" {
  description = "KMS key of the weak-key secret and of the hosts' volumes."
  type        = string
}

variable "boinc_dl_requirement" {
  description = "pip requirement installed into /opt/boinc-dl/venv; null means boinc-dl[<variant>] from the package index."
  type        = string
  default     = null
  validation {
    condition     = var.boinc_dl_requirement == null || !can(regex("['\n]", var.boinc_dl_requirement))
    error_message = "boinc_dl_requirement must not contain a quote or a newline."
  }
}

variable "root_volume_gb" {
  description = "Size of each host's encrypted root volume in GiB (image, venv, BOINC slots)."
  type        = number
  default     = 100
}

variable "min_size" {
  description = "Smallest group size (the controller never goes below it)."
  type        = number
  default     = 0
}

variable "max_size" {
  description = "Largest group size (the controller's max_hosts must not exceed it)."
  type        = number
  default     = 64
}

variable "on_demand_base_capacity" {
  description = "Instances always on-demand, below the percentage split."
  type        = number
  default     = 0
}

variable "on_demand_percentage" {
  description = "OnDemandPercentageAboveBaseCapacity at creation; the controller's fallback changes it at run time."
  type        = number
  default     = 0
}

variable "tags" {
  description = "Tags added to every resource (and propagated to the instances)."
  type        = map(string)
  default     = {}
}
