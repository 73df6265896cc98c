# terraform test, offline: the AWS provider is mocked (no credentials, no API calls);
# the plan evaluates every expression, the cloud-init template included.

mock_provider "aws" {
  mock_data "aws_caller_identity" {
    defaults = {
      account_id = "123456789012"
    }
  }
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }
}

variables {
  name                = "bdl-gpu-spot"
  region              = "us-east-1"
  variant             = "gpu"
  instance_types      = ["g4dn.xlarge", "g5.xlarge"]
  ami_id              = "ami-0123456789abcdef0"
  subnet_ids          = ["subnet-0a", "subnet-0b"]
  vpc_id              = "vpc-0123"
  project_url         = "http://203.0.113.7/boincdl/"
  weak_key_secret_arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:bdl-weak-account-key-AbCdEf"
  kms_key_arn         = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
}

run "gpu_fleet_plan" {
  command = plan

  assert {
    condition     = aws_sqs_queue.interruptions.name == "bdl-gpu-spot-interruptions"
    error_message = "the controller expects the queue <asg>-interruptions"
  }
  assert {
    condition     = aws_autoscaling_group.this.name == "bdl-gpu-spot" && aws_autoscaling_group.this.capacity_rebalance
    error_message = "group name or capacity rebalancing"
  }
  assert {
    condition     = aws_autoscaling_group.this.mixed_instances_policy[0].instances_distribution[0].spot_allocation_strategy == "price-capacity-optimized"
    error_message = "spot allocation strategy"
  }
  assert {
    condition     = length(aws_autoscaling_group.this.mixed_instances_policy[0].launch_template[0].override) == 2
    error_message = "one override per instance type"
  }
  assert {
    condition     = startswith(base64decode(aws_launch_template.this.user_data), "#cloud-config\n")
    error_message = "user-data is the rendered cloud-config"
  }
  assert {
    condition     = strcontains(base64decode(aws_launch_template.this.user_data), "BDL_REQUIREMENT='boinc-dl[gpu]'")
    error_message = "the gpu variant installs boinc-dl[gpu]"
  }
  assert {
    condition     = aws_launch_template.this.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 required"
  }
  assert {
    condition     = jsondecode(aws_cloudwatch_event_rule.interruptions.event_pattern)["detail-type"] == ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
    error_message = "the rule forwards interruption warnings and rebalance recommendations"
  }
}

run "cpu_variant" {
  command = plan

  variables {
    name    = "bdl-cpu-spot"
    variant = "cpu"
  }

  assert {
    condition     = strcontains(base64decode(aws_launch_template.this.user_data), "BDL_REQUIREMENT='boinc-dl[cpu]'")
    error_message = "the cpu variant installs boinc-dl[cpu]"
  }
}

run "one_type_is_refused" {
  command = plan

  variables {
    instance_types = ["g4dn.xlarge"]
  }

  expect_failures = [var.instance_types]
}
